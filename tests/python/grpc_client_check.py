"""Calls the ai-worker's gRPC door with the standard client, `tritonclient.grpc`, and its HTTP
door with `tritonclient.http` on the same inputs: every answer must be equal bit for bit.
Then sends what a client should not: through the client's own generated stubs (typed
contents, a raw length that does not match its shape, an unknown datatype, a missing input,
no token, a message over the worker's limit, a flood of calls) and expects a status code
that names the problem each time, with the worker still serving.

Usage: grpc_client_check.py HTTP_HOST:PORT GRPC_HOST:PORT TOKEN SPEECH.wav MAX_REQUEST_BYTES

Exits non-zero with a message on the first check that fails. Used by tests/tests/worker_grpc.rs.
"""

import concurrent.futures
import sys
import wave

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException


def speech(path):
    """The WAV's 16-bit mono samples as float32 in [-1, 1)."""
    with wave.open(path, "rb") as w:
        assert w.getnchannels() == 1 and w.getsampwidth() == 2 and w.getframerate() == 16000, path
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    return (pcm.astype(np.float32) / 32768.0).astype(np.float32)


def same_bits(a, b, what):
    assert a is not None and b is not None, f"{what}: an output is missing"
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    assert a.tobytes() == b.tobytes(), f"{what}: values differ"


def both(http, grpc_client, headers, model, inputs, outputs=None, version=""):
    """Runs one inference on each door; returns (http result, grpc result)."""
    h_in, g_in = [], []
    for name, array, datatype in inputs:
        h = httpclient.InferInput(name, list(array.shape), datatype)
        h.set_data_from_numpy(array, binary_data=True)
        h_in.append(h)
        g = grpcclient.InferInput(name, list(array.shape), datatype)
        g.set_data_from_numpy(array)
        g_in.append(g)
    h_out = [httpclient.InferRequestedOutput(o, binary_data=True) for o in outputs] if outputs else None
    g_out = [grpcclient.InferRequestedOutput(o) for o in outputs] if outputs else None
    # tritonclient.http adds its own header to the dict it is given: each call gets a copy.
    h_res = http.infer(model, h_in, outputs=h_out, headers=dict(headers), model_version=version)
    g_res = grpc_client.infer(model, g_in, outputs=g_out, headers=dict(headers), model_version=version, request_id="grpc-1")
    return h_res, g_res


def expect_error(call, code, *words):
    try:
        call()
    except InferenceServerException as e:
        assert e.status() == f"StatusCode.{code}", f"wanted {code}, got {e.status()}: {e.message()}"
        for w in words:
            assert w in e.message(), f"{code}: {w!r} not in {e.message()!r}"
        return e
    except grpc.RpcError as e:
        assert e.code() == getattr(grpc.StatusCode, code), f"wanted {code}, got {e.code()}: {e.details()}"
        for w in words:
            assert w in e.details(), f"{code}: {w!r} not in {e.details()!r}"
        return e
    raise AssertionError(f"wanted {code}, the call succeeded")


def main(http_host, grpc_host, token, wav, max_request_bytes):
    auth = {"authorization": f"Bearer {token}"}
    http = httpclient.InferenceServerClient(url=http_host)
    client = grpcclient.InferenceServerClient(url=grpc_host)

    # Health and metadata: liveness and readiness are open, metadata needs the token.
    assert client.is_server_live() and client.is_server_ready()
    for model in ("silero_vad", "silero_stream", "crepe_clip", "mobilenet_v2"):
        assert client.is_model_ready(model), model
    assert not client.is_model_ready("no_such_model"), "an unknown model is not ready"
    server = client.get_server_metadata()
    assert server.name == "vramgate-ai-worker", server
    for model in ("silero_vad", "silero_stream", "crepe_clip", "mobilenet_v2"):
        g = client.get_model_metadata(model, headers=dict(auth), as_json=True)
        h = http.get_model_metadata(model, headers=dict(auth))
        assert g["name"] == h["name"] == model and g["platform"] == h["platform"], (g, h)
        assert g["versions"] == h["versions"] == ["1"], (g, h)
        for side in ("inputs", "outputs"):
            g_t = [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in g[side]]
            h_t = [(t["name"], t["datatype"], t["shape"]) for t in h[side]]
            assert g_t == h_t, (model, side, g_t, h_t)
    expect_error(lambda: client.get_model_metadata("silero_vad"), "UNAUTHENTICATED", "bearer token")
    expect_error(lambda: client.get_model_metadata("no_such_model", headers=dict(auth)), "NOT_FOUND", "no_such_model")

    # One input with a batch dimension: Silero on two rows of real speech.
    audio = speech(wav)
    rows = np.vstack([audio[:16000], audio[8000:24000]]).astype(np.float32)
    h, g = both(http, client, auth, "silero_vad", [("audio", rows, "FP32")])
    same_bits(h.as_numpy("speech_prob"), g.as_numpy("speech_prob"), "silero_vad")
    assert g.as_numpy("speech_prob").shape == (2, 32)
    response = g.get_response()
    assert response.model_name == "silero_vad" and response.model_version == "1" and response.id == "grpc-1", response
    # The admission state rides on the answer's metadata, under the HTTP door's header names.
    _, call = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(grpc_host)).ModelInfer.with_call(
        _raw_request("silero_vad", "audio", rows[:1]), metadata=[("authorization", f"Bearer {token}")])
    stamped = dict(call.initial_metadata())
    for key in ("x-vramgate-admission-unit", "x-vramgate-budget", "x-vramgate-admitted", "x-vramgate-estimate"):
        assert key in stamped, f"no {key} in the answer's metadata: {stamped}"

    # Two inputs, and only one output asked for: Silero's streaming step.
    chunk = audio[:576].reshape(1, 576).astype(np.float32)
    state = np.zeros((1, 2, 128), dtype=np.float32)
    h, g = both(http, client, auth, "silero_stream", [("chunk", chunk, "FP32"), ("state", state, "FP32")])
    same_bits(h.as_numpy("speech_prob"), g.as_numpy("speech_prob"), "silero_stream speech_prob")
    same_bits(h.as_numpy("next_state"), g.as_numpy("next_state"), "silero_stream next_state")
    h, g = both(http, client, auth, "silero_stream", [("chunk", chunk, "FP32"), ("state", state, "FP32")], ["next_state"])
    assert g.as_numpy("speech_prob") is None and g.as_numpy("next_state") is not None, "only the asked output"
    same_bits(h.as_numpy("next_state"), g.as_numpy("next_state"), "silero_stream, next_state asked for")

    # No batch dimension: CREPE over one clip, with the version named.
    clip = audio[:16000].astype(np.float32)
    h, g = both(http, client, auth, "crepe_clip", [("audio", clip, "FP32")], version="1")
    same_bits(h.as_numpy("pitch_hz"), g.as_numpy("pitch_hz"), "crepe_clip pitch")
    same_bits(h.as_numpy("periodicity"), g.as_numpy("periodicity"), "crepe_clip periodicity")

    # UINT8 images: MobileNetV2 on two of them.
    images = np.random.default_rng(3).integers(0, 256, size=(2, 224, 224, 3), dtype=np.uint8)
    h, g = both(http, client, auth, "mobilenet_v2", [("image", images, "UINT8")])
    same_bits(h.as_numpy("logits"), g.as_numpy("logits"), "mobilenet_v2")

    # The same values as typed contents (fp32_contents) answer as the raw ones did.
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(grpc_host))
    meta = [("authorization", f"Bearer {token}")]

    def request(model, inputs, raw=None):
        r = service_pb2.ModelInferRequest(model_name=model)
        for name, datatype, shape, contents in inputs:
            t = r.inputs.add(name=name, datatype=datatype, shape=shape)
            if contents is not None:
                t.contents.CopyFrom(contents)
        if raw is not None:
            r.raw_input_contents.extend(raw)
        return r

    typed = service_pb2.InferTensorContents(fp32_contents=rows.flatten().tolist())
    answer = stub.ModelInfer(request("silero_vad", [("audio", "FP32", [2, 16000], typed)]), metadata=meta)
    got = np.frombuffer(answer.raw_output_contents[0], dtype="<f4").reshape(2, 32)
    want = http.infer("silero_vad", [_http_input("audio", rows)], headers=dict(auth)).as_numpy("speech_prob")
    same_bits(got, want, "typed contents")

    # Hostile input: a status code naming the problem each time.
    call = lambda r: stub.ModelInfer(r, metadata=meta)  # noqa: E731
    expect_error(lambda: call(request("silero_vad", [("audio", "FP32", [1, 16000], None)], [b"\0" * 100])),
                 "INVALID_ARGUMENT", "audio")
    expect_error(lambda: call(request("silero_vad", [("audio", "FP33", [1, 4], None)], [b"\0" * 16])),
                 "INVALID_ARGUMENT", "FP33")
    expect_error(lambda: call(request("silero_stream", [("chunk", "FP32", [1, 576], None)], [chunk.tobytes()])),
                 "INVALID_ARGUMENT", "state")
    expect_error(lambda: call(request("silero_vad", [("audio", "FP32", [1, 100], None)], [b"\0" * 400])),
                 "INVALID_ARGUMENT", "512")
    expect_error(lambda: call(request("no_such_model", [("audio", "FP32", [1, 4], None)], [b"\0" * 16])),
                 "NOT_FOUND", "no_such_model")
    expect_error(lambda: stub.ModelInfer(request("silero_vad", [("audio", "FP32", [1, 16000], None)], [rows[0].tobytes()])),
                 "UNAUTHENTICATED", "bearer token")
    big = int(max_request_bytes) // 4 + 1024
    expect_error(lambda: call(request("silero_vad", [("audio", "FP32", [1, big], None)], [b"\0" * (4 * big)])),
                 "RESOURCE_EXHAUSTED", "max_request_bytes")
    nan = np.full((1, 16000), np.nan, dtype=np.float32)
    expect_error(lambda: call(request("silero_vad", [("audio", "FP32", [1, 16000], None)], [nan.tobytes()])),
                 "INVALID_ARGUMENT", "non-finite")

    # A flood of calls at once: each answered (a result or a retry hint), none lost.
    flood = request("silero_vad", [("audio", "FP32", [1, 16000], None)], [rows[0].tobytes()])
    codes = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=64) as pool:
        futures = [pool.submit(call, flood) for _ in range(256)]
        for f in futures:
            try:
                f.result(timeout=120)
                codes["OK"] = codes.get("OK", 0) + 1
            except grpc.RpcError as e:
                codes[e.code().name] = codes.get(e.code().name, 0) + 1
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e.code()}: {e.details()}"
                assert dict(e.trailing_metadata()).get("retry-after"), "a refusal carries its retry hint"
    assert sum(codes.values()) == 256 and codes.get("OK", 0) > 0, codes
    print(f"flood of 256 calls, 64 at once: {codes}")

    # Still serving, and still equal.
    h, g = both(http, client, auth, "silero_vad", [("audio", rows, "FP32")])
    same_bits(h.as_numpy("speech_prob"), g.as_numpy("speech_prob"), "silero_vad after the hostile calls")
    print("tritonclient.grpc: metadata, readiness and 4 models equal to HTTP bit for bit; hostile calls refused by code")


def _raw_request(model, name, array):
    r = service_pb2.ModelInferRequest(model_name=model)
    r.inputs.add(name=name, datatype="FP32", shape=list(array.shape))
    r.raw_input_contents.append(array.astype("<f4").tobytes())
    return r


def _http_input(name, array):
    h = httpclient.InferInput(name, list(array.shape), "FP32")
    h.set_data_from_numpy(array, binary_data=True)
    return h


if __name__ == "__main__":
    main(*sys.argv[1:6])
