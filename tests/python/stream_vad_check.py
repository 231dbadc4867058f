"""Calls a model of TWO inputs through the ai-worker with the standard `tritonclient[http]`
client: models/repository/silero_stream, Silero VAD's network as a stateless streaming step
(`chunk` [-1, 576] and `state` [-1, 2, 128] in, `speech_prob` [-1] and `next_state` out).
Checks that

- its metadata lists both inputs and both outputs as declared;
- three audio streams stepped at once, each carrying its own state from answer to answer,
  get per step what silero-vad's own model answers when called chunk by chunk on each stream
  alone (model(chunk, 16000), its state kept inside), within 1e-4;
- two streams sent as the rows of one request answer as when sent apart;
- a request whose inputs differ in rows, or that lacks an input, is refused with 400 naming
  them.

    stream_vad_check.py HOST:PORT MODEL WAV

Exits non-zero with a message on the first check that fails. Used by tests/tests/models.rs.
"""

import os
import sys

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from export_models import silero_upstream_probs  # noqa: E402
from reference_pitch import read_wav  # noqa: E402
from unbatched_model_check import batch_sizes  # noqa: E402

CHUNK, CONTEXT = 512, 64
# Steps that share a batch with other rows may differ from a lone call in the last bits of the
# float arithmetic (seen: 1.1e-5); a probability that far off never changes a decision.
MAX_DIFF = 1e-4


def request(chunk, state=None):
    """The inputs of one step (`state` None: left out) and the outputs asked for."""
    inputs = []
    for name, value in (("chunk", chunk), ("state", state)):
        if value is None:
            continue
        inp = httpclient.InferInput(name, list(value.shape), "FP32")
        inp.set_data_from_numpy(value.astype(np.float32))
        inputs.append(inp)
    return inputs, [httpclient.InferRequestedOutput(n) for n in ("speech_prob", "next_state")]


def upstream_probs(audio):
    """silero-vad's own model (as the package loads it) called chunk by chunk on one stream."""
    import silero_vad

    return silero_upstream_probs(silero_vad.load_silero_vad(), audio)


def refused(client, model, chunk, state, needles):
    inputs, asked = request(chunk, state)
    try:
        client.infer(model, inputs, outputs=asked)
    except InferenceServerException as e:
        text = str(e)
        assert all(n in text for n in needles), f"{text} should say {needles}"
        return text
    raise AssertionError(f"accepted: {[i.name() for i in inputs]}")


def main(url, model, wav):
    client = httpclient.InferenceServerClient(url=url, concurrency=4)
    assert client.is_model_ready(model), "model not ready"
    meta = client.get_model_metadata(model)
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [
        ("chunk", "FP32", [-1, 576]), ("state", "FP32", [-1, 2, 128])], meta
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["outputs"]] == [
        ("speech_prob", "FP32", [-1]), ("next_state", "FP32", [-1, 2, 128])], meta

    speech = read_wav(wav)
    n = len(speech) // CHUNK * CHUNK
    # Three streams: the speech, the speech backwards, the speech at a third of the level.
    streams = [speech[:n], speech[:n][::-1].copy(), speech[:n] / 3]
    want = [upstream_probs(s) for s in streams]

    contexts = [np.zeros((1, CONTEXT), np.float32) for _ in streams]
    states = [np.zeros((1, 2, 128), np.float32) for _ in streams]
    got = [[] for _ in streams]
    for i in range(0, n, CHUNK):
        pending = []
        for k, stream in enumerate(streams):
            chunk = np.concatenate([contexts[k], stream[None, i:i + CHUNK]], axis=1)
            contexts[k] = chunk[:, -CONTEXT:]
            inputs, asked = request(chunk, states[k])
            pending.append(client.async_infer(model, inputs, outputs=asked))
        for k, r in enumerate(pending):
            result = r.get_result()
            got[k].append(float(result.as_numpy("speech_prob")[0]))
            states[k] = result.as_numpy("next_state")
    for k, (g, w) in enumerate(zip(got, want)):
        worst = max(abs(a - b) for a, b in zip(g, w))
        assert len(g) == len(w) and worst <= MAX_DIFF, f"stream {k}: worst {worst} over {len(g)} steps"
        print(f"stream {k}: {len(g)} steps, {sum(p > 0.5 for p in w)} of speech, "
              f"worst |worker - silero-vad| {worst:.2e}")

    # Two streams as the rows of one request, for the first 20 steps.
    state = np.zeros((2, 2, 128), np.float32)
    context = np.zeros((2, CONTEXT), np.float32)
    rows = []
    for i in range(0, 20 * CHUNK, CHUNK):
        chunk = np.concatenate([context, np.stack([streams[0][i:i + CHUNK], streams[2][i:i + CHUNK]])], axis=1)
        context = chunk[:, -CONTEXT:]
        inputs, asked = request(chunk, state)
        result = client.infer(model, inputs, outputs=asked)
        rows.append(result.as_numpy("speech_prob"))
        state = result.as_numpy("next_state")
    rows = np.array(rows)
    worst = max(float(np.max(np.abs(rows[:, 0] - want[0][:20]))), float(np.max(np.abs(rows[:, 1] - want[2][:20]))))
    assert worst <= MAX_DIFF, f"two streams as rows: worst {worst}"
    print(f"two streams as the rows of one request: worst {worst:.2e}")

    chunk = np.zeros((2, 576), np.float32)
    print(refused(client, model, chunk, np.zeros((1, 2, 128), np.float32),
                  ["400", "'chunk'", "'state'", "as many rows", "2 and 1"]))
    print(refused(client, model, chunk, None, ["400", "'state'"]))
    rows, batches = batch_sizes(url, model)
    print(f"batches of this model: {int(batches)}, {rows / batches:.2f} rows on average")
    print("model of two inputs: metadata, three streams at once and two as rows, refusals")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
