"""Calls the ai-worker with the standard KServe/Triton HTTP client, `tritonclient[http]`.

Exits non-zero with a message on the first check that fails. Used by tests/tests/worker_oip.rs.
"""

import math
import sys

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


def main(url):
    client = httpclient.InferenceServerClient(url=url)
    assert client.is_server_live(), "server not live"
    assert client.is_server_ready(), "server not ready"
    assert client.is_model_ready("silero_vad"), "model not ready"
    assert not client.is_model_ready("no_such_model"), "unknown model reported ready"

    meta = client.get_model_metadata("silero_vad")
    assert meta["name"] == "silero_vad", meta
    assert meta["inputs"][0]["name"] == "audio" and meta["inputs"][0]["datatype"] == "FP32", meta
    assert meta["outputs"][0]["name"] == "speech_prob", meta
    server = client.get_server_metadata()
    assert "binary_tensor_data" in server["extensions"], server

    # One second of a quiet tone at 16 kHz: 16000 samples -> ceil(16000/512) = 32 windows.
    t = np.arange(16000, dtype=np.float32) / 16000.0
    audio = (0.01 * np.sin(2 * math.pi * 220.0 * t)).astype(np.float32).reshape(1, -1)
    for binary_in in (True, False):
        for binary_out in (True, False):
            inp = httpclient.InferInput("audio", list(audio.shape), "FP32")
            inp.set_data_from_numpy(audio, binary_data=binary_in)
            out = httpclient.InferRequestedOutput("speech_prob", binary_data=binary_out)
            result = client.infer("silero_vad", [inp], outputs=[out], request_id="check-1")
            probs = result.as_numpy("speech_prob")
            assert probs is not None, "no speech_prob in the answer"
            assert probs.shape == (1, 32), f"shape {probs.shape} (binary in={binary_in}, out={binary_out})"
            assert probs.dtype == np.float32, probs.dtype
            assert np.all((probs >= 0.0) & (probs <= 1.0)), probs
            assert result.get_response()["model_name"] == "silero_vad", result.get_response()

    # A batch of two rows gives two rows of probabilities.
    batch = np.vstack([audio, audio])
    inp = httpclient.InferInput("audio", list(batch.shape), "FP32")
    inp.set_data_from_numpy(batch)
    probs = client.infer("silero_vad", [inp]).as_numpy("speech_prob")
    assert probs.shape == (2, 32), probs.shape

    # Errors come back as InferenceServerException with the worker's message.
    bad = httpclient.InferInput("audio", [1, 100], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 100), dtype=np.float32))
    try:
        client.infer("silero_vad", [bad])
        raise AssertionError("too-short audio was accepted")
    except InferenceServerException as e:
        assert "512" in str(e), str(e)
    try:
        client.infer("no_such_model", [inp])
        raise AssertionError("unknown model was accepted")
    except InferenceServerException as e:
        assert "unknown model" in str(e), str(e)
    print("tritonclient checks passed")


if __name__ == "__main__":
    main(sys.argv[1])
