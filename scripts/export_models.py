"""Puts the TorchScript models vramgate serves into a folder, and checks each one loads and runs.

Silero VAD ships as TorchScript inside the `silero-vad` package, so it is copied as it is.
MTCNN's P-Net face detector ships as a pickled state dict inside the `facenet-pytorch` wheel
(passed as the second argument; only its weights file is read, the package is never imported):
the network is defined here, the weights loaded into it, and the result scripted.
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


class PNet(torch.nn.Module):
    """MTCNN stage 1 (Zhang et al. 2016): a fully convolutional face proposal network.

    Input: images [batch, 3, H, W], RGB scaled as (pixel - 127.5) / 128. Output: box offsets
    [batch, 4, h, w] and face probabilities [batch, 2, h, w] (softmax over no-face/face), one
    cell per 12x12 window at stride 2, h = ceil((H - 2) / 2) - 4. Activations grow with H x W,
    which is what makes it the worker's memory-heavy model.
    """

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.conv1 = nn.Conv2d(3, 10, kernel_size=3)
        self.prelu1 = nn.PReLU(10)
        self.pool1 = nn.MaxPool2d(2, 2, ceil_mode=True)
        self.conv2 = nn.Conv2d(10, 16, kernel_size=3)
        self.prelu2 = nn.PReLU(16)
        self.conv3 = nn.Conv2d(16, 32, kernel_size=3)
        self.prelu3 = nn.PReLU(32)
        self.conv4_1 = nn.Conv2d(32, 2, kernel_size=1)
        self.softmax4_1 = nn.Softmax(dim=1)
        self.conv4_2 = nn.Conv2d(32, 4, kernel_size=1)

    def forward(self, x):
        x = self.pool1(self.prelu1(self.conv1(x)))
        x = self.prelu2(self.conv2(x))
        x = self.prelu3(self.conv3(x))
        return self.conv4_2(x), self.softmax4_1(self.conv4_1(x))


def export_pnet(out_dir, wheel):
    import io
    import zipfile

    dst = os.path.join(out_dir, "mtcnn_pnet.jit")
    stamp = dst + ".source"
    source = os.path.basename(wheel)
    if os.path.exists(dst) and os.path.exists(stamp) and open(stamp).read() == source:
        return
    with zipfile.ZipFile(wheel) as z:
        weights = z.read("facenet_pytorch/data/pnet.pt")
    state = torch.load(io.BytesIO(weights), map_location="cpu", weights_only=True)
    net = PNet()
    net.load_state_dict(state)
    net.eval()
    scripted = torch.jit.script(net)
    # Only a smoke check: it runs, and the map's shape follows the formula in PNet's doc.
    with torch.no_grad():
        boxes, probs = scripted(torch.zeros(1, 3, 64, 48))
    if tuple(probs.shape) != (1, 2, 27, 19) or tuple(boxes.shape) != (1, 4, 27, 19):
        sys.exit(f"export_models: pnet returned {tuple(probs.shape)}, {tuple(boxes.shape)}")
    tmp = dst + ".tmp"
    scripted.save(tmp)
    os.replace(tmp, dst)
    with open(stamp, "w") as f:
        f.write(source)
    print(f"export_models: wrote {dst}", file=sys.stderr)


class RangeCheckedVad(torch.nn.Module):
    """A test fixture for the worker's error paths, not a detector: a voice-activity-shaped
    model (`audio_forward(x, sr)` → [batch, ceil(n / 512)]) that answers the clip's RMS per
    window and raises, as real models do on out-of-contract input, when a sample lies outside
    [-1, 1]. The tests use it to check that a model's own error becomes a 500 for that request
    alone while the worker keeps serving."""

    def audio_forward(self, x: torch.Tensor, sr: int) -> torch.Tensor:
        if bool((x.abs() > 1.0).any()):
            raise ValueError("audio samples must lie in [-1, 1]")
        pad = (512 - x.shape[1] % 512) % 512
        x = torch.nn.functional.pad(x, (0, pad))
        return x.reshape(x.shape[0], -1, 512).pow(2).mean(dim=2).sqrt()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.audio_forward(x, 16000)


def export_range_checked(out_dir):
    dst = os.path.join(out_dir, "range_checked_vad.jit")
    if os.path.exists(dst):
        return
    scripted = torch.jit.script(RangeCheckedVad())
    if tuple(scripted.audio_forward(torch.zeros(2, 1000), 16000).shape) != (2, 2):
        sys.exit("export_models: range_checked_vad returned the wrong shape")
    tmp = dst + ".tmp"
    scripted.save(tmp)
    os.replace(tmp, dst)
    print(f"export_models: wrote {dst}", file=sys.stderr)


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "models"
    os.makedirs(out_dir, exist_ok=True)
    export_silero(out_dir)
    export_range_checked(out_dir)
    if len(sys.argv) > 2:
        export_pnet(out_dir, sys.argv[2])


if __name__ == "__main__":
    main()
