"""Reference pitch tracks: torchcrepe's own predict() with the tiny model on WAV files, as JSON
lines on stdout.

    python scripts/reference_pitch.py [--dither] WAV [WAV ...]

prints, per file and in order, one line {"file": "<basename>", "pitch_hz": [...], "periodicity":
[...]}: what `torchcrepe.predict(audio, 16000, hop_length=160, model="tiny",
decoder=torchcrepe.decode.weighted_argmax, return_periodicity=True, pad=True)` answers (fmin 50 Hz
and fmax 2006 Hz, predict's defaults): one value per 10 ms frame, 1 + samples // 160 of them, frame
i centred on sample 160 i. The WAV must be 16 kHz and mono (PCM 8/16/32-bit or float); samples are
scaled to [-1, 1) as torchaudio.load does. Pitch is in Hz for every frame, voiced or not; the
periodicity (the network's activation at the chosen bin, 0..1) says how much to believe it.

torchcrepe's weighted_argmax adds a random triangular dither of up to ±20 cents to each pitch
bin's cents, drawn once per process, which moves its answers by a few cents from run to run.
By default this script replaces that draw with the exact bin cents (the dither's mean), which is
what models/repository/crepe_tiny/model.pt computes; --dither keeps torchcrepe's random dither.

torchcrepe and what it imports come from scripts/setup (step 5).
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_wav(path):
    import numpy as np
    import scipy.io.wavfile

    try:
        rate, data = scipy.io.wavfile.read(path)
    except (OSError, ValueError) as e:
        sys.exit(f"reference_pitch: {path}: {e}")
    if data.ndim != 1:
        sys.exit(f"reference_pitch: {path}: {data.shape[1]} channels, expected mono")
    if rate != 16000:
        sys.exit(f"reference_pitch: {path}: {rate} Hz, expected 16000")
    if data.dtype == np.uint8:
        return (data.astype(np.float32) - 128) / 128
    if data.dtype in (np.int16, np.int32):
        return data.astype(np.float32) / float(-np.iinfo(data.dtype).min)
    if data.dtype in (np.float32, np.float64):
        return data.astype(np.float32)
    sys.exit(f"reference_pitch: {path}: samples of type {data.dtype} are not supported")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("wavs", nargs="+", metavar="WAV")
    ap.add_argument("--dither", action="store_true", help="keep torchcrepe's random ±20 cent dither")
    args = ap.parse_args()

    import torchcrepe

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from export_models import torchcrepe_predict, undithered_weighted_argmax

    if not args.dither:
        undithered_weighted_argmax()

    for path in args.wavs:
        pitch, periodicity = torchcrepe_predict(torchcrepe, read_wav(path))
        print(json.dumps({
            "file": os.path.basename(path),
            "pitch_hz": [float(p) for p in pitch],
            "periodicity": [float(p) for p in periodicity],
        }), flush=True)


if __name__ == "__main__":
    main()
