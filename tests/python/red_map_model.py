"""Writes the small TorchScript model tests/tests/object_storage.rs stores outputs of: its input
`image` is UINT8 `[batch, 512, 512, 3]` (NHWC), its outputs `map` and `mask` are both FP32
`[batch, 512, 512]`, the red channel over 255: a map the size of a segmentation mask whose
every value the test can compute from the image itself, exactly (one float32 division).

Usage: red_map_model.py OUT.pt
"""

import sys

import torch


class RedMap(torch.nn.Module):
    def forward(self, image: torch.Tensor):
        red = image[..., 0].to(torch.float32) / 255.0
        return red, red.clone()


def write(out: str) -> None:
    scripted = torch.jit.script(RedMap().eval())
    probe = torch.randint(0, 256, (2, 512, 512, 3), dtype=torch.uint8)
    red, mask = scripted(probe)
    assert red.shape == (2, 512, 512) and red.dtype == torch.float32, red.shape
    assert torch.equal(red, probe[..., 0].float() / 255.0) and torch.equal(red, mask)
    scripted.save(out)


if __name__ == "__main__":
    write(sys.argv[1])
