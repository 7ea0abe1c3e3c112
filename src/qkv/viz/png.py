"""PNG heatmaps with matplotlib's Agg backend (no display needed).

- layer and head given: one ``L × L`` heatmap with token labels on both axes;
- layer only: that layer's heads side by side; head only: that head in every layer;
- neither: the whole ``layers × heads`` grid.

Rows are queries (the attending token), columns keys; the focus token's row is outlined in red.
Several panels are drawn as one mosaic image on one set of axes: 72 separate matplotlib axes
with tick labels took 12 s to lay out on this 2-core machine, the mosaic well under a second.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ._maps import AttentionMaps

_GAP = 1  # blank cells between panels of the mosaic


def render(
    maps: AttentionMaps,
    path: str | Path,
    *,
    focus: int | None = None,
    layer: int | None = None,
    head: int | None = None,
    dpi: int = 110,
) -> None:
    """Write the heatmap figure to ``path`` (PNG); see the module docstring for the layouts."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    L = len(maps.tokens)
    layers = list(range(maps.n_layers)) if layer is None else [layer]
    heads = list(range(maps.n_heads)) if head is None else [head]
    if head is None and layer is not None:  # one layer's heads: wrap into rows of 6
        cols = min(len(heads), 6)
        cells = [(layer, h) for h in heads]
    elif layer is None and head is not None:  # one head through the layers, in a row
        cols = len(layers)
        cells = [(li, head) for li in layers]
    else:
        cols = len(heads)
        cells = [(li, h) for li in layers for h in heads]
    rows = -(-len(cells) // cols)
    step = L + _GAP
    mosaic = torch.full((rows * step - _GAP, cols * step - _GAP), float("nan"))
    for n, (li, h) in enumerate(cells):
        r, c = divmod(n, cols)
        mosaic[r * step : r * step + L, c * step : c * step + L] = maps.weights[li, h]

    single = len(cells) == 1
    longest = max((len(t) for t in maps.tokens), default=1)
    cell_in = 0.3 if single else max(0.07, min(0.2, 2.2 / max(L, 1)))
    # Stay well inside Agg's 2^16-pixel limit for long texts: at most 60 x 40 inches of cells.
    cell_in = min(cell_in, 60 / mosaic.shape[1], 40 / mosaic.shape[0])
    labelled = cell_in >= 0.06  # below ~4 pt per row token labels are unreadable: leave them out
    font = 9.0 if single else max(4.0, min(7.0, cell_in * 40))
    # A fixed layout computed from the label lengths: matplotlib's constrained layout draws
    # the whole figure an extra time to measure it (~1 s of the 72-panel grid, measured).
    label_in = longest * font * 0.62 / 72 + 0.15 if labelled else 0.1  # ~0.62 em per char
    axis_in = 0.35 if single else 0.0  # "token" / "attends to" axis labels
    left, bottom = label_in + axis_in + 0.2, label_in + axis_in + 0.2
    top, right = 0.75, 1.3  # title and panel labels; colour bar
    plot_w, plot_h = mosaic.shape[1] * cell_in, mosaic.shape[0] * cell_in
    fig_w = max(left + plot_w + right, 4.5)
    fig_h = bottom + plot_h + top
    fig = Figure(figsize=(fig_w, fig_h))
    ax = fig.add_axes((left / fig_w, bottom / fig_h, plot_w / fig_w, plot_h / fig_h))
    bar_h = min(plot_h, 3.0)
    cax = fig.add_axes(
        (
            (left + plot_w + 0.3) / fig_w,
            (bottom + plot_h - bar_h) / fig_h,
            0.15 / fig_w,
            bar_h / fig_h,
        )
    )
    image = ax.imshow(mosaic.numpy(), cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
    ax.set_facecolor("white")
    for spine in ax.spines.values():
        spine.set_visible(False)
    # Token labels on the left of each panel row and under each panel column.
    if labelled:
        ys = [r * step + i for r in range(rows) for i in range(L)]
        xs = [c * step + j for c in range(cols) for j in range(L)]
        ax.set_yticks(ys, [maps.tokens[i] for _ in range(rows) for i in range(L)], fontsize=font)
        ax.set_xticks(
            xs, [maps.tokens[j] for _ in range(cols) for j in range(L)], fontsize=font, rotation=90
        )
    else:
        ax.set_xticks([])
        ax.set_yticks([])
    ax.tick_params(length=0)
    for n, (li, h) in enumerate(cells):
        r, c = divmod(n, cols)
        label = f"layer {li} · head {h}"
        if not single and layer is None and head is None:
            label = f"L{li} H{h}"
        ax.text(
            c * step + (L - 1) / 2, r * step - 0.7, label, ha="center", va="bottom",
            fontsize=10 if single else font,
        )  # fmt: skip
        if focus is not None:
            outline = Rectangle(
                (c * step - 0.5, r * step + focus - 0.5), L, 1, fill=False, edgecolor="red",
                linewidth=1.2,
            )  # fmt: skip
            ax.add_patch(outline)
    if single:
        ax.set_xlabel("attends to")
        ax.set_ylabel("token")
    name = f"{maps.model}: " if maps.model else ""
    title = f"{name}{maps.text}"
    fig.suptitle(title if len(title) <= 100 else title[:99] + "…", fontsize=11, y=1 - 0.15 / fig_h)
    fig.colorbar(image, cax=cax, label="attention weight")
    fig.savefig(path, format="png", dpi=dpi)
