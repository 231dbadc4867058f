"""Calls a *declared* model of the ai-worker (MTCNN's O-Net, whose tensors only its config entry
describes) with the standard `tritonclient[http]` client, and compares its answers with
facenet-pytorch's own ONet module, loaded from the package's weights, on the same crops.

Exits non-zero with a message on the first check that fails. Used by tests/tests/worker_oip.rs.
"""

import sys

import numpy as np
import torch
import tritonclient.http as httpclient
from facenet_pytorch.models.mtcnn import ONet
from tritonclient.utils import InferenceServerException

MODEL = "mtcnn_onet"
OUTPUTS = ["box_offsets", "landmarks", "face_prob"]


def main(url):
    client = httpclient.InferenceServerClient(url=url)
    assert client.is_model_ready(MODEL), "model not ready"
    meta = client.get_model_metadata(MODEL)
    inputs = [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]]
    outputs = [(t["name"], t["datatype"], t["shape"]) for t in meta["outputs"]]
    assert inputs == [("image", "FP32", [-1, 3, 48, 48])], meta
    assert outputs == [
        ("box_offsets", "FP32", [-1, 4]),
        ("landmarks", "FP32", [-1, 10]),
        ("face_prob", "FP32", [-1, 2]),
    ], meta

    # Three crops as MTCNN scales them, (pixel - 127.5) / 128, from a fixed seed.
    rng = np.random.default_rng(7)
    crops = ((rng.integers(0, 256, size=(3, 3, 48, 48)).astype(np.float32) - 127.5) * 0.0078125).astype(np.float32)
    reference = ONet(pretrained=True).eval()
    with torch.no_grad():
        want = [t.numpy() for t in reference(torch.from_numpy(crops))]

    for binary in (True, False):
        inp = httpclient.InferInput("image", list(crops.shape), "FP32")
        inp.set_data_from_numpy(crops, binary_data=binary)
        asked = [httpclient.InferRequestedOutput(name, binary_data=binary) for name in OUTPUTS]
        result = client.infer(MODEL, [inp], outputs=asked)
        for name, expected in zip(OUTPUTS, want):
            got = result.as_numpy(name)
            assert got is not None and got.shape == expected.shape, f"{name}: {None if got is None else got.shape}"
            diff = float(np.max(np.abs(got - expected)))
            assert diff < 1e-4, f"{name} differs from facenet-pytorch's ONet by {diff} (binary={binary})"
            print(f"{name}: max |worker - facenet-pytorch| = {diff:.2e} (binary={binary})")

    # A crop of the wrong size is refused with 400, naming the input and the declared shape.
    wrong = np.zeros((1, 3, 24, 24), dtype=np.float32)
    inp = httpclient.InferInput("image", list(wrong.shape), "FP32")
    inp.set_data_from_numpy(wrong)
    try:
        client.infer(MODEL, [inp])
    except InferenceServerException as e:
        text = str(e)
        assert "400" in text or "[-1, 3, 48, 48]" in text, text
        assert "'image'" in text and "[-1, 3, 48, 48]" in text, text
    else:
        raise AssertionError("a 24x24 crop was accepted by O-Net")
    print("declared model: metadata, inference (binary and JSON) and a refusal all as declared")


if __name__ == "__main__":
    main(sys.argv[1])
