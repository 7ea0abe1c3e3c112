"""Cross-attention over audio: what each word of a transcript listened to.

A speech model's text decoder cross-attends to the encoded audio: for each word, every head
of every layer holds a softmax over the audio's positions (Whisper: 1500 of 20 ms per 30-s
window). :class:`AudioAttention` holds those rows for a whole recording; :func:`top_span`
reads a head's most attended stretch of time from one row; :func:`render_png` draws the
spectrogram, the words × time map and the focus word's heads × time map on one time axis;
:func:`render_html` wraps that picture and every word's spans in one offline page.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass
from pathlib import Path

import torch

Tensor = torch.Tensor

__all__ = ["AudioAttention", "Span", "render_html", "render_png", "top_span"]


@dataclass(frozen=True)
class Span:
    """The stretch of positions ``lo..hi`` (inclusive) around a row's largest weight (at
    ``peak``) whose weights are at least half of it, and ``mass``, their sum."""

    lo: int
    hi: int
    peak: int
    mass: float


def top_span(row: Tensor) -> Span:
    """The top span of one attention row ``[P]`` (weights over P positions): the peak (the
    first position of the largest weight) widened while the neighbours keep at least half
    the peak's weight, as a full width at half maximum."""
    w = row.double()
    peak = int(w.argmax())
    half = float(w[peak]) / 2
    below = (w < half).tolist()
    lo = peak
    while lo > 0 and not below[lo - 1]:
        lo -= 1
    hi = peak
    while hi + 1 < len(below) and not below[hi + 1]:
        hi += 1
    return Span(lo, hi, peak, float(w[lo : hi + 1].sum()))


@dataclass
class AudioAttention:
    """A recording's transcript and its cross-attention, on one time axis.

    Attributes:
        mel: ``[n_mels, F]`` log-mel features of the audio, ``F`` frames of ``frame_s``.
        words: the ``W`` words of the transcript, as shown (no leading space).
        times: ``(start, end)`` of each word in seconds (the model's own word timing).
        weights: ``[W, layers, heads, P]`` float32: word ``k``'s row in each head, the
            attention of the decoder query that predicted the word's first token, placed
            on the recording's ``P`` positions of ``position_s`` seconds (positions of other
            windows and of padding are 0).
        heads: the ``(layer, head)`` pairs the words × time map averages.
        heads_label: how its title names them ("the alignment heads", "L3 H1").
        text, model, source: the transcript, the model's name and the audio file's name.
    """

    mel: Tensor
    words: list[str]
    times: list[tuple[float, float]]
    weights: Tensor
    heads: list[tuple[int, int]]
    heads_label: str
    text: str = ""
    model: str = ""
    source: str = ""
    frame_s: float = 0.01
    position_s: float = 0.02

    def __post_init__(self) -> None:
        if self.weights.ndim != 4 or self.weights.shape[0] != len(self.words):
            raise ValueError(
                f"weights must be [words, layers, heads, positions] with {len(self.words)} "
                f"words, got {list(self.weights.shape)}"
            )

    @property
    def n_layers(self) -> int:
        return self.weights.shape[1]

    @property
    def n_heads(self) -> int:
        return self.weights.shape[2]

    @property
    def duration(self) -> float:
        return self.mel.shape[1] * self.frame_s

    def span(self, word: int, layer: int, head: int) -> Span:
        """The top span of ``word``'s row in ``(layer, head)``."""
        return top_span(self.weights[word, layer, head])

    def seconds(self, s: Span) -> tuple[float, float, float]:
        """``(start, end, peak)`` of a span in seconds (the peak position's middle)."""
        p = self.position_s
        return s.lo * p, (s.hi + 1) * p, (s.peak + 0.5) * p

    def word_map(self) -> Tensor:
        """``[W, P]``: each word's row averaged over :attr:`heads`, scaled to its maximum."""
        rows = torch.stack([self.weights[:, li, h] for li, h in self.heads]).mean(0)  # [W, P]
        return rows / rows.amax(-1, keepdim=True).clamp_min(1e-12)


def render_png(
    maps: AudioAttention,
    path: str | Path | io.BytesIO,
    *,
    focus: int,
    layer: int | None = None,
    head: int | None = None,
    dpi: int = 100,
) -> None:
    """Write the picture: the spectrogram with the words' times, the words × time map
    (:meth:`AudioAttention.word_map`, word ``focus`` outlined) and, for the focus word, each
    head's row over time (``layer``/``head`` restrict them), each scaled to its maximum."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    W, P = len(maps.words), maps.weights.shape[-1]
    end = P * maps.position_s
    layers = range(maps.n_layers) if layer is None else [layer]
    heads = range(maps.n_heads) if head is None else [head]
    cells = [(li, h) for li in layers for h in heads]
    per_head = torch.stack([maps.weights[focus, li, h] for li, h in cells])  # [cells, P]
    per_head = per_head / per_head.amax(-1, keepdim=True).clamp_min(1e-12)

    width = min(max(8.0, 2.0 + 1.6 * maps.duration), 30.0)
    row_in = 0.22
    heights = [1.6, max(1.2, W * row_in), max(1.2, len(cells) * 0.16)]
    fig_h = sum(heights) + 1.9
    fig = Figure(figsize=(width, fig_h))
    axes = fig.subplots(3, 1, sharex=True, height_ratios=heights)
    # fixed margins in inches: the title, then the rotated word labels above the spectrogram
    fig.subplots_adjust(
        left=1.3 / width, right=1 - 0.3 / width, top=1 - 0.95 / fig_h, bottom=0.55 / fig_h
    )
    spec, words_ax, heads_ax = axes
    spec.imshow(
        maps.mel.numpy(), origin="lower", aspect="auto", cmap="magma", interpolation="nearest",
        extent=(0.0, maps.duration, 0.0, float(maps.mel.shape[0])),
    )  # fmt: skip
    spec.set_ylabel("mel bin")
    for k, (s, e) in enumerate(maps.times):
        spec.axvline(s, color="white", linewidth=0.6, alpha=0.6)
        spec.text(
            (s + e) / 2, maps.mel.shape[0] + 1, maps.words[k], ha="center", va="bottom",
            fontsize=7, rotation=45 if W > 12 else 0,
            color="red" if k == focus else "black",
        )  # fmt: skip
    extent = (0.0, end, W - 0.5, -0.5)
    words_ax.imshow(
        maps.word_map().numpy(), aspect="auto", cmap="viridis", interpolation="nearest",
        extent=extent, vmin=0.0, vmax=1.0,
    )  # fmt: skip
    words_ax.set_yticks(range(W), maps.words, fontsize=7 if W > 20 else 8)
    words_ax.add_patch(
        Rectangle((0, focus - 0.5), end, 1, fill=False, edgecolor="red", linewidth=1.2)
    )
    words_ax.set_title(
        f"each word's cross-attention over time: mean of {maps.heads_label} (rows scaled to "
        "their max)",
        fontsize=9, loc="left",
    )  # fmt: skip
    heads_ax.imshow(
        per_head.numpy(), aspect="auto", cmap="viridis", interpolation="nearest",
        extent=(0.0, end, len(cells) - 0.5, -0.5), vmin=0.0, vmax=1.0,
    )  # fmt: skip
    heads_ax.set_yticks(range(len(cells)), [f"L{li} H{h}" for li, h in cells], fontsize=6)
    heads_ax.set_title(
        f"“{maps.words[focus]}”: each head's cross-attention over time (rows scaled to their max)",
        fontsize=9, loc="left",
    )  # fmt: skip
    heads_ax.set_xlabel("time (s)")
    heads_ax.set_xlim(0.0, maps.duration)
    title = f"{maps.model}: {maps.text.strip()}"
    fig.suptitle(title if len(title) <= 140 else title[:139] + "…", fontsize=10, y=1 - 0.12 / fig_h)
    fig.savefig(path, format="png", dpi=dpi)


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; \
style-src 'unsafe-inline'; img-src data:">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>qkv explain: {title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5rem; color: #222; }}
p.meta {{ color: #555; }}
img {{ max-width: 100%; border: 1px solid #ddd; }}
table {{ border-collapse: collapse; margin: 0.5rem 0 1rem; font-size: 0.9rem; }}
td, th {{ padding: 0.15rem 0.6rem; border-bottom: 1px solid #eee; text-align: right; }}
th {{ background: #f5f5f5; }}
tr.align td {{ font-weight: bold; }}
summary {{ cursor: pointer; margin: 0.3rem 0; }}
.bar {{ display: inline-block; height: 0.7rem; background: #3b8; vertical-align: middle; }}
</style>
</head>
<body>
<h1>qkv explain: what each word listened to</h1>
<p class="text">{text}</p>
<p class="meta">{meta}</p>
<img alt="spectrogram, words × time and heads × time cross-attention"
  src="data:image/png;base64,{png}">
<h2>Each word's top span in every head</h2>
<p class="meta">{legend}</p>
{words}
</body>
</html>
"""


def _word_table(maps: AudioAttention, k: int, marked: set[tuple[int, int]]) -> str:
    rows = ["<tr><th>layer</th><th>head</th><th>span (s)</th><th>peak (s)</th>"
            "<th>weight in span</th><th></th></tr>"]  # fmt: skip
    for li in range(maps.n_layers):
        for h in range(maps.n_heads):
            s = maps.span(k, li, h)
            a, b, peak = maps.seconds(s)
            cls = ' class="align"' if (li, h) in marked else ""
            rows.append(
                f"<tr{cls}><td>{li}</td><td>{h}{' *' if cls else ''}</td>"
                f"<td>{a:.2f}–{b:.2f}</td><td>{peak:.2f}</td><td>{s.mass:.2f}</td>"
                f'<td><span class="bar" style="width:{100 * s.mass:.0f}px"></span></td></tr>'
            )
    return "<table>" + "".join(rows) + "</table>"


def render_html(
    maps: AudioAttention,
    *,
    focus: int,
    layer: int | None = None,
    head: int | None = None,
    marked: list[tuple[int, int]] | None = None,
) -> str:
    """One offline page (no script, no network): the :func:`render_png` picture embedded,
    and every word's top span in every head, the focus word's table open. ``marked``
    ``(layer, head)`` pairs are shown in bold with a star (the alignment heads)."""
    buf = io.BytesIO()
    render_png(maps, buf, focus=focus, layer=layer, head=head)
    png = base64.b64encode(buf.getvalue()).decode("ascii")
    stars = set(marked or [])
    parts = []
    for k, word in enumerate(maps.words):
        s, e = maps.times[k]
        opened = " open" if k == focus else ""
        parts.append(
            f"<details{opened}><summary>{k}: <b>{html.escape(word)}</b> "
            f"({s:.2f}–{e:.2f} s)</summary>{_word_table(maps, k, stars)}</details>"
        )
    meta = (
        f"{maps.model}: {maps.n_layers} decoder layers × {maps.n_heads} cross-attention heads; "
        f"{maps.source}, {maps.duration:.2f} s."
    )
    legend = (
        "Row of the decoder query that predicted the word's first token. Span: the positions "
        f"({1000 * maps.position_s:.0f} ms each) around the head's largest weight that keep at "
        "least half of it; weight in span: their share of the head's attention. Bold and * = "
        "the marked heads (the alignment heads, which time the words)."
    )
    return _PAGE.format(
        title=html.escape(maps.text.strip()[:80]),
        text=html.escape(maps.text.strip()),
        meta=html.escape(meta),
        png=png,
        legend=html.escape(legend),
        words="\n".join(parts),
    )
