"""Writes version N of the small TorchScript model tests/tests/model_versions.rs rolls out: its
input `x` is FP32 `[batch, 4]`, its output `y` is `x + N`, so every answer says which version
made it. It carries a buffer of FLOATS zeros (weights, as far as memory goes), so that a version
that is never freed shows in the worker's memory.

Usage: versioned_model.py OUT.pt N FLOATS
"""

import sys

import torch


class Shift(torch.nn.Module):
    def __init__(self, offset: float, floats: int):
        super().__init__()
        self.register_buffer("offset", torch.tensor([offset], dtype=torch.float32))
        self.register_buffer("weights", torch.zeros(max(floats, 1), dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.offset + self.weights[:1] * 0.0


def write(out: str, version: int, floats: int) -> None:
    scripted = torch.jit.script(Shift(float(version), floats).eval())
    y = scripted(torch.ones(2, 4))
    assert torch.equal(y, torch.full((2, 4), 1.0 + version)), y
    scripted.save(out)


if __name__ == "__main__":
    write(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
