"""Writes a small TorchScript model whose outputs are of every datatype the worker serves, for
tests/tests/output_datatypes.rs. Its input `tokens` is INT64 `[batch, n]` (token ids, 0 padding);
its outputs, a dict:

- `length` INT64 `[batch]`: the count of non-zero tokens;
- `total` INT64 `[batch]`: the tokens' sum (exact past 2^53, where a float is not);
- `count32` INT32 `[batch]`: `length` again;
- `mask` BOOL `[batch, n]`: token != 0;
- `clipped` UINT8 `[batch, n]`: the tokens clamped to 0..255;
- `half` FP16 `[batch, n]`: `clipped` as half-precision floats;
- `mean` FP32 `[batch]`: the tokens' mean as a float.

Usage: token_stats_model.py OUT.pt
"""

import sys
from typing import Dict

import torch


class TokenStats(torch.nn.Module):
    def forward(self, tokens: torch.Tensor) -> Dict[str, torch.Tensor]:
        nonzero = tokens != 0
        length = nonzero.sum(dim=1)
        clipped = tokens.clamp(0, 255).to(torch.uint8)
        return {
            "length": length,
            "total": tokens.sum(dim=1),
            "count32": length.to(torch.int32),
            "mask": nonzero,
            "clipped": clipped,
            "half": clipped.to(torch.float16),
            "mean": tokens.to(torch.float32).mean(dim=1),
        }


def main(out):
    scripted = torch.jit.script(TokenStats().eval())
    answer = scripted(torch.tensor([[5, 0, 2**53 + 2, 300]], dtype=torch.int64))
    assert answer["total"].item() == 2**53 + 307, answer
    assert answer["length"].dtype == torch.int64 and answer["mask"].dtype == torch.bool, answer
    scripted.save(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1])
