"""Calls a model WITHOUT a batch dimension (Triton's max_batch_size = 0) through the ai-worker
with the standard `tritonclient[http]` client: models/repository/crepe_clip, torchcrepe's tiny
CREPE taking one clip's whole 16 kHz signal, `audio` FP32 [-1]. Checks that

- its metadata is the declared shapes, with no batch dimension added;
- its answers on real speech agree with torchcrepe.predict itself (without dither) within 25
  cents on every voiced frame, sent as binary and as JSON;
- six clips of one length sent at once each get their own answer, equal to the one it gets
  alone (the worker runs them one at a time: its batch-size histogram counts only batches of 1);
- a request with a batch dimension ([1, n]) is refused with 400, naming the input and [-1].

    unbatched_model_check.py HOST:PORT MODEL WAV

Exits non-zero with a message on the first check that fails. Used by tests/tests/models.rs.
"""

import os
import sys
import urllib.request

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from export_models import torchcrepe_predict, undithered_weighted_argmax  # noqa: E402
from reference_pitch import read_wav  # noqa: E402

MAX_CENTS = 25.0
VOICED = 0.5
OUTPUTS = ["pitch_hz", "periodicity"]


def request(audio, binary=True):
    inp = httpclient.InferInput("audio", list(audio.shape), "FP32")
    inp.set_data_from_numpy(audio, binary_data=binary)
    return [inp], [httpclient.InferRequestedOutput(name, binary_data=binary) for name in OUTPUTS]


def infer(client, model, audio, binary=True):
    inputs, asked = request(audio, binary)
    result = client.infer(model, inputs, outputs=asked)
    return [result.as_numpy(name) for name in OUTPUTS]


def batch_sizes(url, model):
    """The worker's batch-size histogram for `model`: (sum of rows, batches)."""
    text = urllib.request.urlopen(f"http://{url}/metrics").read().decode()
    found = {}
    for line in text.splitlines():
        for key in ("sum", "count"):
            if line.startswith(f'inference_batch_size_{key}{{model="{model}"}}'):
                found[key] = float(line.split()[-1])
    return found.get("sum", 0.0), found.get("count", 0.0)


def main(url, model, wav):
    client = httpclient.InferenceServerClient(url=url, concurrency=8)
    assert client.is_model_ready(model), "model not ready"
    meta = client.get_model_metadata(model)
    inputs = [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]]
    outputs = [(t["name"], t["datatype"], t["shape"]) for t in meta["outputs"]]
    assert inputs == [("audio", "FP32", [-1])], meta
    assert outputs == [("pitch_hz", "FP32", [-1]), ("periodicity", "FP32", [-1])], meta

    audio = read_wav(wav)
    want_pitch, want_per = (t.numpy() for t in torchcrepe_predict(undithered_weighted_argmax(), audio))
    voiced = want_per > VOICED
    assert voiced.sum() > 50, f"only {voiced.sum()} voiced frames in {wav}"
    for binary in (True, False):
        pitch, per = infer(client, model, audio, binary)
        assert pitch.shape == want_pitch.shape == per.shape, (pitch.shape, want_pitch.shape, per.shape)
        cents = np.abs(1200 * np.log2(pitch[voiced] / want_pitch[voiced]))
        worst = float(cents.max())
        assert worst <= MAX_CENTS, f"{worst:.2f} cents from torchcrepe on a voiced frame (binary={binary})"
        per_diff = float(np.abs(per - want_per).max())
        assert per_diff < 0.05, f"periodicity differs by {per_diff} (binary={binary})"
        print(f"crepe_clip vs torchcrepe.predict: {int(voiced.sum())}/{len(pitch)} voiced frames, "
              f"worst {worst:.4f} cents, periodicity {per_diff:.2g} (binary={binary})")

    # Six clips of one length at once (requests a batched model would share batches with):
    # each answered alone, as when sent alone.
    before = batch_sizes(url, model)
    n = len(audio) // 6
    clips = [audio[k * n:(k + 1) * n] for k in range(6)]
    alone = [infer(client, model, clip) for clip in clips]
    # tritonclient's own concurrency (gevent, not threads): all six in flight, then the answers.
    pending = []
    for clip in clips:
        inputs, asked = request(clip)
        pending.append(client.async_infer(model, inputs, outputs=asked))
    results = [r.get_result() for r in pending]
    together = [[result.as_numpy(name) for name in OUTPUTS] for result in results]
    for clip, a, t in zip(clips, alone, together):
        assert a[0].shape == (1 + len(clip) // 160,), (len(clip), a[0].shape)
        assert all(np.array_equal(x, y) for x, y in zip(a, t)), f"clip of {len(clip)} samples answered differently"
    after = batch_sizes(url, model)
    runs = after[1] - before[1]
    assert runs == 12 and after[0] - before[0] == runs, f"batches of one expected: {before} -> {after}"
    print(f"six clips at once: each answered as alone, in {int(runs)} batches of one request")

    # A batch dimension the model does not take: 400, naming the input and its shape.
    try:
        infer(client, model, audio[None, :16000])
    except InferenceServerException as e:
        text = str(e)
        assert "'audio'" in text and "[-1]" in text and "[1, 16000]" in text, text
    else:
        raise AssertionError("a [1, 16000] request was accepted by a model without a batch dimension")
    print("model without a batch dimension: metadata, inference (binary and JSON), one request a batch, a refusal")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
