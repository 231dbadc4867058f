"""Puts the TorchScript models vramgate serves into a folder, and checks each one loads and runs.

Silero VAD ships as TorchScript inside the `silero-vad` package, so it is copied as it is.
Quiet when the models are already there and unchanged.
"""

import hashlib
import os
import shutil
import sys

import torch


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def export_silero(out_dir):
    import silero_vad

    src = os.path.join(os.path.dirname(silero_vad.__file__), "data", "silero_vad.jit")
    dst = os.path.join(out_dir, "silero_vad.jit")
    if os.path.exists(dst) and sha256(dst) == sha256(src):
        return
    tmp = dst + ".tmp"
    shutil.copyfile(src, tmp)
    model = torch.jit.load(tmp)
    probs = model.audio_forward(torch.zeros(1, 16000), 16000)
    if tuple(probs.shape) != (1, 32):
        sys.exit(f"export_models: silero_vad returned shape {tuple(probs.shape)}, expected (1, 32)")
    os.replace(tmp, dst)
    print(f"export_models: wrote {dst}", file=sys.stderr)


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "models"
    os.makedirs(out_dir, exist_ok=True)
    export_silero(out_dir)


if __name__ == "__main__":
    main()
