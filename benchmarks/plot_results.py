"""Plots of recorded benchmark results, read from the tables of benchmarks/RESULTS.md.

The documentation's performance page shows these; the site's build makes them afresh from
RESULTS.md (docs/_hooks/plots.py), so a plot can never disagree with the recorded table it
draws. Each figure names the RESULTS.md section it reads; the section gives the date, the
machine and the exact command (the performance page repeats them under each plot).

    python benchmarks/plot_results.py OUT_DIR      # writes OUT_DIR/<name>.svg
"""

from __future__ import annotations

import io
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")

Table = list[list[str]]


def section(text: str, heading: str) -> str:
    """The text under the first heading that starts with ``heading`` (``### Sweep``), up to
    the next heading of the same or a higher level."""
    lines = text.splitlines()
    level = len(heading) - len(heading.lstrip("#"))
    for i, line in enumerate(lines):
        if line.startswith(heading):
            out = []
            for nxt in lines[i + 1 :]:
                m = re.match(r"(#+) ", nxt)
                if m and len(m.group(1)) <= level:
                    break
                out.append(nxt)
            return "\n".join(out)
    raise ValueError(f"RESULTS.md has no section {heading!r}")


def tables(text: str) -> list[Table]:
    """The Markdown tables of ``text``: rows of stripped cells, header first, rule dropped."""
    found: list[Table] = []
    current: Table = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                current.append(cells)
        elif current:
            found.append(current)
            current = []
    return found


def number(cell: str) -> float:
    """The first number in a cell (``**54.0×**`` -> 54.0)."""
    m = re.search(r"-?\d+(?:\.\d+)?", cell.replace(",", ""))
    if m is None:
        raise ValueError(f"no number in {cell!r}")
    return float(m.group())


@dataclass(frozen=True)
class Figure:
    name: str
    heading: str  # the RESULTS.md section it reads
    draw: Callable[[str, object], None]  # (section text, matplotlib axes)


def _sweep(text: str, ax) -> None:  # type: ignore[no-untyped-def]
    head, *rows = tables(text)[0]
    lengths = [int(number(c)) for c in head[1:4]]
    for row in rows:
        ax.plot(lengths, [number(c) for c in row[1:4]], marker="o", label=row[0])
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set(xscale="log", yscale="log", xlabel="sequence length n", ylabel="qkv time / SDPA time")
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_title("Forward, fp32, B=1 H=8 D=64: below 1 is faster than SDPA")
    ax.legend(fontsize=8)


def _decode(text: str, ax) -> None:  # type: ignore[no-untyped-def]
    _, *rows = tables(text)[0]
    keys = [int(number(r[0])) for r in rows]
    pairs = [re.findall(r"(\d+(?:\.\d+)?) vs (\d+(?:\.\d+)?)", r[1])[0] for r in rows]
    ax.plot(keys, [float(a) for a, _ in pairs], marker="o", label="qkv.attention (decode kernel)")
    ax.plot(keys, [float(b) for _, b in pairs], marker="s", label="F.sdpa(enable_gqa=True)")
    ax.set(xscale="log", yscale="log", xlabel="cached keys", ylabel="µs per call")
    ax.set_title("One decode step, q [1, 9, 1, 64], k/v [1, 3, n, 64], 2 threads")
    ax.legend(fontsize=8)


def _hf(text: str, ax) -> None:  # type: ignore[no-untyped-def]
    _, *rows = tables(text)[0]
    cases, speedups = [], []
    for row in rows:  # the recorded "sdpa/qkv N.NNx" of each case that has one
        m = re.search(r"sdpa/qkv \**(\d+(?:\.\d+)?)x", row[4])
        if m:
            cases.append(row[0].replace(": ", ":\n", 1))
            speedups.append(float(m.group(1)))
    _bars(ax, cases, speedups, "tab:blue", "x")
    ax.set(xlabel="sdpa time / qkv time (higher: qkv faster)")
    ax.set_title("transformers: attn_implementation 'qkv' against 'sdpa'")


def _bars(ax, labels: list[str], values: list[float], color: str, unit: str = "") -> None:  # type: ignore[no-untyped-def]
    """Horizontal bars, one a label, each with its value, and a line at 1.0 (the peer)."""
    y = range(len(values))
    ax.barh(list(y), values, color=color)
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="gray", lw=0.8, ls="--")
    for i, v in zip(y, values, strict=True):
        ax.text(v, i, f" {v:.2f}{unit}", va="center", fontsize=7)


def _models(text: str, ax) -> None:  # type: ignore[no-untyped-def]
    _, *rows = tables(text)[0]
    labels = [f"{r[0]}\n(vs {r[1]})" for r in rows]
    ratios = [number(r[4]) for r in rows]
    _bars(ax, labels, ratios, "tab:green")
    ax.set(xlabel="qkv time / peer time (lower: qkv faster)")
    ax.set_title("qkv.models' all-MiniLM-L6-v2 against its peers")


def _train(text: str, ax) -> None:  # type: ignore[no-untyped-def]
    head, *rows = tables(text)[0]
    col = next(i for i, c in enumerate(head) if c.startswith("qkv / SDPA time"))
    labels = [f"{r[0]}, {r[1]}, {r[2]}" for r in rows]
    ratios = [number(r[col]) for r in rows]
    _bars(ax, labels, ratios, "tab:purple")
    ax.set(xlabel="qkv time / SDPA time per training step (lower: qkv faster)")
    ax.set_title("nanoGPT-style training step, B=8 T=256, 2 threads (mask, compile, dtype)")


FIGURES = (
    Figure("sweep", "### Sweep (`qkv bench`, forward", _sweep),
    Figure("decode", "### Decode on qkv's decode kernel", _decode),
    Figure("hf", "## Hugging Face transformers on qkv", _hf),
    Figure("models", "## qkv.models: encode and attention_maps", _models),
    Figure("train", "## Training a nanoGPT-style model (2026-12-08)", _train),
)


def render(results: Path = RESULTS) -> dict[str, bytes]:
    """``{name: SVG bytes}`` for every figure; the same RESULTS.md gives the same bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    text = results.read_text(encoding="utf-8")
    out = {}
    with plt.rc_context({"svg.hashsalt": "qkv", "svg.fonttype": "path"}):
        for fig_spec in FIGURES:
            fig, ax = plt.subplots(figsize=(7.5, 4.2))
            fig_spec.draw(section(text, fig_spec.heading), ax)
            fig.tight_layout()
            buf = io.BytesIO()
            fig.savefig(buf, format="svg", metadata={"Date": None})
            plt.close(fig)
            out[fig_spec.name] = buf.getvalue()
    return out


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python benchmarks/plot_results.py OUT_DIR")
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for name, svg in render().items():
        (out / f"{name}.svg").write_bytes(svg)
        print(out / f"{name}.svg")


if __name__ == "__main__":
    main(sys.argv[1:])
