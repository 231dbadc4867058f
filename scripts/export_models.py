"""Puts the TorchScript models vramgate serves into a folder, and checks each one loads and runs.

Silero VAD ships as TorchScript inside the `silero-vad` package, so it is copied as it is.
MTCNN's three face detection stages (P-Net, R-Net, O-Net) ship as pickled state dicts inside the
`facenet-pytorch` wheel (passed as the second argument; only its weights files are read, the
package is never imported): each network is defined here exactly as facenet-pytorch defines it,
its weights loaded strictly, and the result scripted into mtcnn_pnet.jit, mtcnn_rnet.jit and
mtcnn_onet.jit. R-Net and O-Net are checked against the eager network they were scripted from.
range_checked_vad.jit is a test fixture, defined here. Quiet when the models are already there
and unchanged.
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


class RNet(torch.nn.Module):
    """MTCNN stage 2: refines P-Net's candidate windows, each cut out and resized to 24x24.

    Input: [batch, 3, 24, 24], scaled like P-Net's. Output: box offsets [batch, 4] and face
    probabilities [batch, 2] (softmax over no-face/face). As in facenet-pytorch, the conv output
    [batch, 64, 3, 3] is permuted to [batch, W, H, C] before flattening: its dense weights were
    converted from a channels-last (TensorFlow/Caffe) layout and depend on that order.
    """

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.conv1 = nn.Conv2d(3, 28, kernel_size=3)
        self.prelu1 = nn.PReLU(28)
        self.pool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv2 = nn.Conv2d(28, 48, kernel_size=3)
        self.prelu2 = nn.PReLU(48)
        self.pool2 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv3 = nn.Conv2d(48, 64, kernel_size=2)
        self.prelu3 = nn.PReLU(64)
        self.dense4 = nn.Linear(576, 128)
        self.prelu4 = nn.PReLU(128)
        self.dense5_1 = nn.Linear(128, 2)
        self.softmax5_1 = nn.Softmax(dim=1)
        self.dense5_2 = nn.Linear(128, 4)

    def forward(self, x):
        x = self.pool1(self.prelu1(self.conv1(x)))
        x = self.pool2(self.prelu2(self.conv2(x)))
        x = self.prelu3(self.conv3(x))
        x = x.permute(0, 3, 2, 1).contiguous()
        x = self.prelu4(self.dense4(x.view(x.shape[0], -1)))
        return self.dense5_2(x), self.softmax5_1(self.dense5_1(x))


class ONet(torch.nn.Module):
    """MTCNN stage 3: scores R-Net's survivors again at 48x48 and places five landmarks.

    Input: [batch, 3, 48, 48], scaled like P-Net's. Output: box offsets [batch, 4], landmarks
    [batch, 10] (five x offsets then five y offsets, as fractions of the box's width and height),
    and face probabilities [batch, 2]. The conv output is permuted before flattening, like R-Net's.
    """

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.conv1 = nn.Conv2d(3, 32, kernel_size=3)
        self.prelu1 = nn.PReLU(32)
        self.pool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3)
        self.prelu2 = nn.PReLU(64)
        self.pool2 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv3 = nn.Conv2d(64, 64, kernel_size=3)
        self.prelu3 = nn.PReLU(64)
        self.pool3 = nn.MaxPool2d(2, 2, ceil_mode=True)
        self.conv4 = nn.Conv2d(64, 128, kernel_size=2)
        self.prelu4 = nn.PReLU(128)
        self.dense5 = nn.Linear(1152, 256)
        self.prelu5 = nn.PReLU(256)
        self.dense6_1 = nn.Linear(256, 2)
        self.softmax6_1 = nn.Softmax(dim=1)
        self.dense6_2 = nn.Linear(256, 4)
        self.dense6_3 = nn.Linear(256, 10)

    def forward(self, x):
        x = self.pool1(self.prelu1(self.conv1(x)))
        x = self.pool2(self.prelu2(self.conv2(x)))
        x = self.pool3(self.prelu3(self.conv3(x)))
        x = self.prelu4(self.conv4(x))
        x = x.permute(0, 3, 2, 1).contiguous()
        x = self.prelu5(self.dense5(x.view(x.shape[0], -1)))
        return self.dense6_2(x), self.dense6_3(x), self.softmax6_1(self.dense6_1(x))


def _export_mtcnn(out_dir, wheel, name, net_cls, check):
    """Scripts `net_cls` with facenet-pytorch's `<name>.pt` weights into mtcnn_<name>.jit, then
    calls check(eager, exported) on the eager network and the saved file loaded back. Skipped when
    the file exists and its stamp names the same wheel."""
    import io
    import zipfile

    dst = os.path.join(out_dir, f"mtcnn_{name}.jit")
    stamp = dst + ".source"
    source = os.path.basename(wheel)
    if os.path.exists(dst) and os.path.exists(stamp) and open(stamp).read() == source:
        return
    with zipfile.ZipFile(wheel) as z:
        weights = z.read(f"facenet_pytorch/data/{name}.pt")
    state = torch.load(io.BytesIO(weights), map_location="cpu", weights_only=True)
    net = net_cls()
    net.load_state_dict(state)  # strict: every name and shape must match facenet-pytorch's
    net.eval()
    scripted = torch.jit.script(net)
    tmp = dst + ".tmp"
    scripted.save(tmp)
    try:
        check(net, torch.jit.load(tmp, map_location="cpu"))
    except BaseException:
        os.remove(tmp)
        raise
    os.replace(tmp, dst)
    with open(stamp, "w") as f:
        f.write(source)
    print(f"export_models: wrote {dst}", file=sys.stderr)


def export_pnet(out_dir, wheel):
    def check(eager, exported):
        # Only a smoke check: it runs, and the map's shape follows the formula in PNet's doc.
        with torch.no_grad():
            boxes, probs = exported(torch.zeros(1, 3, 64, 48))
        if tuple(probs.shape) != (1, 2, 27, 19) or tuple(boxes.shape) != (1, 4, 27, 19):
            sys.exit(f"export_models: pnet returned {tuple(probs.shape)}, {tuple(boxes.shape)}")

    _export_mtcnn(out_dir, wheel, "pnet", PNet, check)


def _check_against_eager(name, size, shapes):
    """A check for _export_mtcnn: on fixed pseudo-random crops (batch 1 and 3, values in the
    networks' input range), the exported model's outputs have `shapes` (per row) and match the
    eager network's to 1e-5."""

    def check(eager, exported):
        gen = torch.Generator().manual_seed(20160401)
        for batch in (1, 3):
            x = torch.rand(batch, 3, size, size, generator=gen) * 2 - 1
            with torch.no_grad():
                want, got = eager(x), exported(x)
            if len(got) != len(shapes):
                sys.exit(f"export_models: {name} returned {len(got)} outputs, expected {len(shapes)}")
            for k, (w, g, cols) in enumerate(zip(want, got, shapes)):
                if tuple(g.shape) != (batch, cols):
                    sys.exit(f"export_models: {name} output {k} has shape {tuple(g.shape)} "
                             f"for batch {batch}, expected {(batch, cols)}")
                diff = (w - g).abs().max().item()
                if not diff < 1e-5:
                    sys.exit(f"export_models: {name} output {k} differs from the eager network "
                             f"by {diff:.3g} (batch {batch}; limit 1e-5)")

    return check


def export_rnet(out_dir, wheel):
    # (box offsets [N, 4], probabilities [N, 2])
    _export_mtcnn(out_dir, wheel, "rnet", RNet, _check_against_eager("rnet", 24, (4, 2)))


def export_onet(out_dir, wheel):
    # (box offsets [N, 4], landmarks [N, 10], probabilities [N, 2])
    _export_mtcnn(out_dir, wheel, "onet", ONet, _check_against_eager("onet", 48, (4, 10, 2)))


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
        export_rnet(out_dir, sys.argv[2])
        export_onet(out_dir, sys.argv[2])


if __name__ == "__main__":
    main()
