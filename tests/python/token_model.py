"""Writes a small token model for the model-error test (tests/tests/model_errors.rs).

    python token_model.py OUT_PATH

`nn.Embedding(100, 8)` then the mean over the sequence: INT64 token ids `[batch, n]` in, FP32
`[batch, 8]` out. A token id outside [0, 100) makes the model itself raise (`index out of range
in self`), as a text model does on an id past its vocabulary. Prints that message, taken from
the scripted model, so the test can look for the model's own words in the dead letter.
"""

import sys

import torch


class TokenMean(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(100, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding(tokens).mean(dim=1)


def main():
    torch.manual_seed(0)
    scripted = torch.jit.script(TokenMean().eval())
    out = scripted(torch.tensor([[1, 2, 3], [4, 5, 99]]))
    if tuple(out.shape) != (2, 8) or out.dtype != torch.float32:
        sys.exit(f"token_model: got {tuple(out.shape)} {out.dtype}, expected (2, 8) float32")
    try:
        scripted(torch.tensor([[1, 100, 3]]))
    except RuntimeError as e:
        print(str(e).strip().splitlines()[-1])
    else:
        sys.exit("token_model: an id past the embedding did not raise")
    scripted.save(sys.argv[1])


if __name__ == "__main__":
    main()
