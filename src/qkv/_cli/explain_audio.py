"""``qkv explain --audio FILE``: what did a word of the transcript listen to?

Whisper's text decoder cross-attends to the encoded audio (1500 positions of 20 ms per 30-s
window). For one word of the transcript (default: the first content word), each decoder
layer's heads are shown with the stretch of audio they attended to most, in seconds: the row
of the query that predicted the word's first token, its largest weight and the neighbours
that keep at least half of it (:func:`qkv.viz.audio.top_span`). ``--png``/``--html`` draw
the cross-attention over the spectrogram (words × time).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qkv.viz.audio import AudioAttention

DEFAULT_MODEL = "whisper-tiny.en"
# Words skipped when choosing the default word: the most common English function words.
# fmt: off
_FUNCTION_WORDS = frozenset({
    "a", "an", "the", "and", "or", "but", "if", "so", "of", "to", "in", "on", "at", "by",
    "for", "with", "from", "as", "is", "are", "was", "were", "be", "been", "am", "it",
    "its", "this", "that", "these", "those", "i", "you", "he", "she", "we", "they", "me",
    "him", "her", "us", "them", "my", "your", "his", "our", "their", "do", "does", "did",
    "not", "no", "yes",
})
# fmt: on


def is_whisper(model: str | None) -> bool:
    """Whether ``--model`` names a Whisper model (by name or a CTranslate2 Whisper folder),
    decided before anything loads."""
    if model is None:
        return False
    if model.lower().startswith("whisper"):
        return True
    from qkv.models.whisper import is_whisper_folder

    return Path(model).is_dir() and is_whisper_folder(Path(model))


def _bare(word: str) -> str:
    return word.strip().strip(".,!?;:\"'“”()[]{}-").lower()


def _word_list(words: list[str], limit: int = 60) -> str:
    """``0:The 1:cat ...``; a long transcript's list ends after ``limit`` words."""
    shown = " ".join(f"{i}:{w}" for i, w in enumerate(words[:limit]))
    return shown if len(words) <= limit else f"{shown} ... ({len(words) - limit} more)"


def find_word(words: list[str], want: str | None) -> tuple[int, str]:
    """The index of the word to explain and how it was chosen: ``--token`` as a word
    (case and punctuation ignored; its first occurrence) or ``#N``; by default the first
    word that is not a function word."""
    if not words:
        raise ValueError("the audio has no speech to explain: its transcript is empty")
    if want is None:
        for i, w in enumerate(words):
            if _bare(w) and _bare(w) not in _FUNCTION_WORDS:
                return i, "the first content word; --token WORD or #N picks another"
        return 0, "the first word; --token WORD or #N picks another"
    if re.fullmatch(r"#\d+", want):
        i = int(want[1:])
        if i >= len(words):
            raise ValueError(
                f"--token {want} is out of range: the transcript has {len(words)} words "
                f"(#0..#{len(words) - 1}): {_word_list(words)}"
            )
        return i, f"word #{i}"
    key = _bare(want)
    for i, w in enumerate(words):
        if _bare(w) == key and key:
            return i, f"--token {want!r}"
    raise ValueError(
        f"--token {want!r} is not a word of the transcript; its words are {_word_list(words)} "
        f"(give one of them or #N for word N)"
    )


def audio_attention(model: Any, samples: Any, source: str, name: str) -> AudioAttention:
    """Transcribe ``samples`` with ``model`` (a :class:`qkv.models.whisper.SpeechRecognizer`)
    and place every word's cross-attention rows on the recording's time axis."""
    import torch

    from qkv.viz.audio import AudioAttention

    heard = model.word_attention(samples)
    mel = model.features(samples)[:, :-1]  # the frame after the last sample is not content
    c = model.config
    P = -(-mel.shape[1] // 2)  # 20-ms positions of the audio
    size = max(P, *(round(w.offset / 0.02) + 1500 for w in heard)) if heard else P
    weights = torch.zeros(len(heard), c.n_text_layers, c.n_text_heads, size)
    for k, w in enumerate(heard):
        at = round(w.offset / 0.02)
        weights[k, :, :, at : at + 1500] = w.weights[:, :, 0]  # the first token's row
    heads = [(int(a), int(b)) for a, b in model.alignment_heads]
    return AudioAttention(
        mel=mel,
        words=[w.word.word.strip() for w in heard],
        times=[(w.word.start, w.word.end) for w in heard],
        weights=weights,
        heads=heads,
        heads_label="the alignment heads",
        text="".join(w.word.word for w in heard),
        model=name,
        source=source,
    )


def _check_range(what: str, value: int | None, n: int, name: str) -> None:
    if value is not None and not 0 <= value < n:
        raise ValueError(
            f"--{what} {value} is out of range: {name} has {n} decoder {what}s (0..{n - 1})"
        )


def run_audio(args: argparse.Namespace, png: Path | None, html_path: Path | None) -> int:
    """The ``--audio`` branch of ``qkv explain`` (the arguments already checked there)."""
    import torch

    import qkv.models
    from qkv.models.whisper import SpeechRecognizer, read_wav

    if args.hf is not None:
        raise ValueError("--audio runs a Whisper model; give --model, not --hf")
    if args.text is not None:
        raise ValueError(
            f"give either a text or --audio, not both (got the text {args.text!r} and "
            f"--audio {args.audio!r})"
        )
    name = args.model or DEFAULT_MODEL
    if not is_whisper(name):
        raise ValueError(
            f"--audio needs a speech model, and --model {name!r} is not one; give --model "
            f"{DEFAULT_MODEL} (the default with --audio) or a CTranslate2 Whisper folder"
        )
    samples = read_wav(args.audio)  # a bad file is refused before the model loads
    torch.set_num_threads(1)  # tiny matrices and a token-by-token loop: one thread is fastest
    model = qkv.models.load(name)
    if not isinstance(model, SpeechRecognizer):
        raise ValueError(f"--model {name!r} is not a Whisper model; give {DEFAULT_MODEL}")
    c = model.config
    _check_range("layer", args.layer, c.n_text_layers, name)
    _check_range("head", args.head, c.n_text_heads, name)
    maps = audio_attention(model, samples, Path(args.audio).name, Path(name).name)
    focus, why = find_word(maps.words, args.token)
    marked = list(maps.heads)  # the alignment heads, starred in the tables
    if args.layer is not None or args.head is not None:  # the words x time map shows them
        maps.heads = [
            (li, h)
            for li in range(c.n_text_layers)
            for h in range(c.n_text_heads)
            if args.layer in (None, li) and args.head in (None, h)
        ]
        maps.heads_label = ", ".join(f"L{li} H{h}" for li, h in maps.heads)
    _print(maps, focus, why, args.layer, args.head, marked)
    if png is not None:
        from qkv.viz.audio import render_png

        render_png(maps, png, focus=focus, layer=args.layer, head=args.head)
        print(f"wrote {png}")
    if html_path is not None:
        from qkv.viz.audio import render_html

        page = render_html(maps, focus=focus, layer=args.layer, head=args.head, marked=marked)
        html_path.write_text(page, encoding="utf-8")
        print(f"wrote {html_path} (open it in a browser; it works offline)")
    return 0


def _print(
    maps: AudioAttention,
    focus: int,
    why: str,
    layer: int | None,
    head: int | None,
    marked: list[tuple[int, int]],
) -> None:
    from rich.bar import Bar
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(highlight=False)
    words = Text()
    for i, w in enumerate(maps.words):
        words.append(w, style="bold reverse" if i == focus else "")
        words.append(str(i), style="dim")
        words.append(" ")
    console.print(
        Text.assemble(
            ("Model:  ", "dim"),
            f"{maps.model} ({maps.n_layers} decoder layers × {maps.n_heads} cross-attention "
            "heads over the audio, 20 ms a position)",
        )
    )
    console.print(Text.assemble(("Audio:  ", "dim"), f"{maps.source} ({maps.duration:.2f} s)"))
    console.print(Text.assemble(("Text:   ", "dim"), maps.text.strip()))
    console.print(Text.assemble(("Words:  ", "dim"), words))
    s, e = maps.times[focus]
    console.print(
        Text.assemble(
            ("Word:   ", "dim"),
            (f"“{maps.words[focus]}”", "bold"),
            f" (word {focus}, {why}); spoken {s:.2f}–{e:.2f} s by the alignment heads' timing",
        )
    )
    console.print()
    table = Table(
        title=Text.assemble("Where did ", (f"“{maps.words[focus]}”", "bold"), " listen?"),
        title_justify="left",
    )
    for col in ("layer", "head", "span (s)", "peak (s)", "weight in span", ""):
        table.add_column(col, justify="right")
    starred = set(marked)
    layers = range(maps.n_layers) if layer is None else [layer]
    heads = range(maps.n_heads) if head is None else [head]
    for li in layers:
        for h in heads:
            span = maps.span(focus, li, h)
            a, b, peak = maps.seconds(span)
            after = "†" if a >= maps.duration else ""  # zeros after the audio
            table.add_row(
                str(li) if h == heads[0] else "",
                f"{h}{' *' if (li, h) in starred else ''}",
                f"{a:.2f}–{b:.2f}{after}",
                f"{peak:.2f}",
                f"{span.mass:.2f}",
                Bar(1.0, 0.0, span.mass, width=12, color="cyan"),
                end_section=h == heads[-1],
            )
    console.print(table)
    console.print(
        Text(
            "Each head's row for the query that predicted the word's first token, over the "
            "audio's 20-ms positions. span: the positions around the largest weight that keep "
            "at least half of it; weight in span: their share of the head's attention. "
            "* = an alignment head (they time the words). † = after the audio's end (the "
            "window's zero padding).",
            style="dim",
        )
    )
