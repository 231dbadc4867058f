"""Checks the objects a stored `[[outputs]]` row wrote (tests/tests/object_storage.rs), read
back from the object store into files, against the input photograph, with numpy and Pillow as
a consumer would read them: the `.npy` is the model's map (the red channel over 255), the
`.png` mask is that map thresholded at 0.5, at the photograph's own size.

Usage: stored_outputs_check.py PHOTO MAP.npy MASK.png exact|resized
  exact:   the photograph is the model input's size; both must be equal, value for value.
  resized: the photograph was letterboxed into the model input; the map must have the model's
           shape and the mask the photograph's size, agreeing with the photograph's own
           thresholded red channel on at least 97% of its pixels (resampling moves edges).
Prints a JSON line of figures.
"""

import json
import sys

import numpy as np
from PIL import Image


def main(photo: str, map_path: str, mask_path: str, mode: str) -> None:
    rgb = np.asarray(Image.open(photo).convert("RGB"))
    red = rgb[..., 0].astype(np.float32) / np.float32(255.0)
    stored = np.load(map_path)
    mask_image = Image.open(mask_path)
    assert mask_image.mode == "L", mask_image.mode
    mask = np.asarray(mask_image)
    assert mask.shape == rgb.shape[:2], f"mask {mask.shape}, photo {rgb.shape[:2]}"
    assert set(np.unique(mask).tolist()) <= {0, 255}, np.unique(mask)
    want_mask = np.where(red >= np.float32(0.5), 255, 0).astype(np.uint8)
    agree = float((mask == want_mask).mean())
    if mode == "exact":
        assert stored.dtype == np.float32 and stored.shape == (1,) + red.shape, (stored.dtype, stored.shape)
        assert np.array_equal(stored[0], red), f"map differs at {int((stored[0] != red).sum())} values"
        assert agree == 1.0, f"mask agrees on {agree:.6f}"
    else:
        assert stored.dtype == np.float32 and stored.shape == (1, 512, 512), (stored.dtype, stored.shape)
        assert agree >= 0.97, f"mask agrees with the photo's threshold on {agree:.4f} of pixels"
    print(json.dumps({"map_shape": list(stored.shape), "mask_size": list(mask.shape), "agreement": agree}))


if __name__ == "__main__":
    main(*sys.argv[1:5])
