"""Reference face detections: facenet-pytorch's own MTCNN on photographs, as JSON on stdout.

    python scripts/mtcnn_reference.py [--min-face-size N] [--thresholds A,B,C] [--timings]
        PHOTO [PHOTO ...]

prints {"<basename>": {"width": W, "height": H, "faces": [{"box": [x1, y1, x2, y2], "prob": p,
"landmarks": [[x, y] x 5]}, ...]}, ...}: what `MTCNN(keep_all=True, device="cpu")
.detect(img, landmarks=True)` answers for each photograph, with facenet-pytorch's defaults
(min_face_size 20, thresholds 0.6, 0.7, 0.7, factor 0.709) unless the flags say otherwise. The
image is read as `PIL.ImageOps.exif_transpose(Image.open(path)).convert("RGB")`; coordinates are
pixels of that image, unclamped floats as MTCNN gives them (a box may reach past the edges).
Faces are in MTCNN's order for keep_all with select_largest (its default): largest box first.
Landmarks are, in MTCNN's order: the eye on the image's left, the other eye, the nose tip, the
mouth corner on the image's left, the other mouth corner.

facenet-pytorch, torchvision and Pillow come from scripts/setup (step 5); MTCNN reads its weights
from the package's data, so nothing is downloaded. --timings prints each photograph's detection
time (model loading excluded) to stderr.
"""

import argparse
import json
import os
import sys
import time


def parse_thresholds(text):
    parts = text.split(",")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError("expected three comma-separated numbers, e.g. 0.6,0.7,0.7")
    try:
        return [float(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not numbers: {text}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("photos", nargs="+", metavar="PHOTO")
    ap.add_argument("--min-face-size", type=int, default=20)
    ap.add_argument("--thresholds", type=parse_thresholds, default=[0.6, 0.7, 0.7])
    ap.add_argument("--timings", action="store_true", help="detection seconds per photo, to stderr")
    args = ap.parse_args()

    names = [os.path.basename(p) for p in args.photos]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        sys.exit(f"mtcnn_reference: photographs share a base name: {', '.join(dupes)}")

    from PIL import Image, ImageOps
    from facenet_pytorch import MTCNN

    mtcnn = MTCNN(
        keep_all=True,
        device="cpu",
        min_face_size=args.min_face_size,
        thresholds=args.thresholds,
    )

    out = {}
    for path, name in zip(args.photos, names):
        with Image.open(path) as raw:
            img = ImageOps.exif_transpose(raw).convert("RGB")
        start = time.perf_counter()
        boxes, probs, points = mtcnn.detect(img, landmarks=True)
        seconds = time.perf_counter() - start
        faces = []
        if boxes is not None:
            for box, prob, pts in zip(boxes, probs, points):
                faces.append({
                    "box": [float(v) for v in box],
                    "prob": float(prob),
                    "landmarks": [[float(x), float(y)] for x, y in pts],
                })
        out[name] = {"width": img.width, "height": img.height, "faces": faces}
        if args.timings:
            print(f"mtcnn_reference: {name}: {len(faces)} faces in {seconds:.3f} s", file=sys.stderr)

    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
