"""Terminal rendering with rich: the tokens, then per layer what one token attends to.

Token text always goes through ``rich.text.Text`` (never markup strings), so a token such as
``[bold]`` prints literally.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._maps import AttentionMaps

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.text import Text

_BAR = 12  # bar width in cells: weight 1.0 fills it
_TOKEN = 14  # longer tokens are cut with an ellipsis in the tables


def _top_grid(maps: AttentionMaps, pairs: list[tuple[int, float]]) -> RenderableType:
    from rich.bar import Bar
    from rich.table import Table
    from rich.text import Text

    width = min(max(len(t) for t in maps.tokens), _TOKEN)  # one width for every cell
    grid = Table.grid(padding=(0, 1))
    grid.add_column(width=width, no_wrap=True, overflow="ellipsis")
    grid.add_column(justify="right", width=4, no_wrap=True)
    grid.add_column(width=_BAR)
    for j, w in pairs:
        grid.add_row(
            Text(maps.tokens[j], style="bold"),
            Text(f"{w:.2f}"),
            Bar(1.0, 0.0, w, width=_BAR, color="cyan"),
        )
    return grid


def token_line(maps: AttentionMaps, focus: int) -> Text:
    """The tokens with their positions, the focus token highlighted."""
    from rich.text import Text

    line = Text()
    for i, tok in enumerate(maps.tokens):
        style = "bold reverse" if i == focus else ""
        line.append(tok, style=style)
        line.append(str(i), style="dim")
        line.append(" ")
    return line


def render(
    maps: AttentionMaps,
    *,
    focus: int,
    top: int,
    layer: int | None,
    head: int | None,
    console: Console,
) -> None:
    """Print the tokens and, for token ``focus``, each layer's ``top`` most attended tokens:
    averaged over heads, and in the most focused head (lowest entropy) or head ``head``.
    ``layer`` restricts the table to one layer."""
    from rich.table import Table
    from rich.text import Text

    tok = maps.tokens[focus]
    console.print(
        Text.assemble(
            ("Model:  ", "dim"), f"{maps.model} ({maps.n_layers} layers × {maps.n_heads} heads)"
        )
    )
    console.print(Text.assemble(("Text:   ", "dim"), maps.text))
    console.print(Text.assemble(("Tokens: ", "dim"), token_line(maps, focus)))
    console.print()
    title = Text.assemble("What does ", (f"“{tok}”", "bold"), f" (token {focus}) attend to?")
    table = Table(title=title, title_justify="left", show_lines=True)
    table.add_column("layer", justify="center", vertical="middle")
    table.add_column(f"mean of {maps.n_heads} heads")
    table.add_column("head", vertical="middle")
    table.add_column("that head")
    layers = range(maps.n_layers) if layer is None else [layer]
    for li in layers:
        if head is None:
            h, ent = maps.most_focused_head(li, focus)
        else:
            h, ent = head, float(maps.entropy(li, focus)[head])
        table.add_row(
            str(li),
            _top_grid(maps, maps.top(li, focus, top)),
            Text.assemble(str(h), ("\nH=", "dim"), (f"{ent:.2f}", "dim")),
            _top_grid(maps, maps.top(li, focus, top, head=h)),
        )
    console.print(table)
    console.print(
        Text(
            "Weights rebuilt by qkv.inspect from each layer's log-sum-exp. "
            + ("head = the most focused one: lowest " if head is None else "")
            + f"H = entropy in nats (uniform over {len(maps.tokens)} tokens: "
            f"{maps.max_entropy:.2f}).",
            style="dim",
        )
    )
