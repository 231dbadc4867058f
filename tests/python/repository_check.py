"""The worker's repository extension through the standard `tritonclient.http` client, as a
Triton user calls it (tests/tests/model_versions.rs). The worker serves `shift` version 1 from
REPO in `explicit` mode; this script writes version 2 beside it and rolls it out:

- the index lists `shift` version 1 READY (Triton's `name`, `version`, `state`);
- `is_model_ready` per version, `infer` with and without `model_version`, and every answer's
  `model_version`;
- `load_model` after version 2's folder appears: version 2 serves, version 1 (out of the
  default policy, the newest only) is retired;
- `unload_model`: not ready, the index says UNAVAILABLE or UNLOADING; `load_model` again: ready;
- the same calls through `tritonclient.grpc` at GRPC_HOST:PORT, with the same states.

Usage: repository_check.py HOST:PORT REPO GRPC_HOST:PORT
"""

import os
import sys
import time

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

sys.path.insert(0, os.path.dirname(__file__))
from versioned_model import write  # noqa: E402

MODEL = "shift"


def infer(client, version=""):
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    tensor = httpclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    result = client.infer(MODEL, [tensor], model_version=version)
    y = result.as_numpy("y")
    answered = result.get_response()["model_version"]
    np.testing.assert_array_equal(y, x + float(answered))
    return answered


def states(client):
    return {(e["name"], e.get("version", "")): e["state"] for e in client.get_model_repository_index()}


def main(url, repo, grpc_url):
    client = httpclient.InferenceServerClient(url=url)
    index = client.get_model_repository_index()
    assert {"name": MODEL, "version": "1", "state": "READY"} in index, index
    assert client.is_model_ready(MODEL, "1") and not client.is_model_ready(MODEL, "2")
    assert infer(client) == "1" and infer(client, "1") == "1"
    meta = client.get_model_metadata(MODEL)
    assert meta["versions"] == ["1"], meta

    os.makedirs(os.path.join(repo, MODEL, "2"))
    write(os.path.join(repo, MODEL, "2", "model.pt"), 2, 1024)
    client.load_model(MODEL)
    assert client.is_model_ready(MODEL, "2"), "version 2 serves once the load returns"
    assert not client.is_model_ready(MODEL, "1"), "version 1 is out of the policy: retired"
    assert infer(client) == "2" and infer(client, "2") == "2"
    try:
        infer(client, "1")
        raise AssertionError("version 1 answered after it was retired")
    except InferenceServerException as e:
        assert "has no version 1 ready (ready: 2)" in str(e), str(e)
    assert client.get_model_metadata(MODEL, "2")["versions"] == ["2"]
    assert states(client)[(MODEL, "2")] == "READY"

    client.unload_model(MODEL)
    assert not client.is_model_ready(MODEL)
    deadline = time.time() + 30
    while states(client).get((MODEL, "")) != "UNAVAILABLE":
        assert time.time() < deadline, client.get_model_repository_index()
        time.sleep(0.1)
    try:
        infer(client)
        raise AssertionError("an unloaded model answered")
    except InferenceServerException as e:
        assert "is not loaded" in str(e), str(e)
    client.load_model(MODEL)
    assert client.is_model_ready(MODEL) and infer(client) == "2"

    grpc = grpcclient.InferenceServerClient(url=grpc_url)
    models = grpc.get_model_repository_index(as_json=True)["models"]
    assert {"name": MODEL, "version": "2", "state": "READY"} in models, models
    grpc.unload_model(MODEL)
    assert not grpc.is_model_ready(MODEL) and not client.is_model_ready(MODEL)
    try:
        grpc.unload_model(MODEL)
        raise AssertionError("a second unload succeeded")
    except InferenceServerException as e:
        assert "no version of it is loaded" in str(e) and e.status() == "StatusCode.INVALID_ARGUMENT", (str(e), e.status())
    grpc.load_model(MODEL)
    assert grpc.is_model_ready(MODEL, "2") and infer(client) == "2"
    print("repository calls: ok")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
