"""One self-contained, offline HTML page to explore every layer and head of a text.

The page is a head view in the spirit of BertViz: the tokens twice, lines from each token to
the tokens it attends to (one colour per head, opacity = weight), a layer menu and head
toggles, plus the mean matrix of the selected heads and the top tokens of the hovered one.

Safety: all text reaches the page either HTML-escaped (title, text) or inside a JSON block with
``<``, ``>`` and ``&`` escaped, and the script shows tokens with ``textContent`` only. A
Content-Security-Policy allows exactly the page's own script (by its hash) and no network.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
from importlib import resources
from typing import Any

import torch

from ._maps import AttentionMaps

_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; \
script-src '{script_hash}'; style-src 'unsafe-inline'; img-src data:">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>qkv explain: {title}</title>
<style>
{css}</style>
</head>
<body>
<h1>qkv explain</h1>
<p class="text">{text}</p>
<p class="meta">{meta}</p>
<div class="controls">
  <select id="layer" aria-label="layer"></select>
  <span>heads</span><div id="heads"></div>
  <button id="all-heads" type="button">all heads</button>
</div>
<div class="panes">
  <svg id="view" xmlns="http://www.w3.org/2000/svg" role="img" aria-label="attention lines"></svg>
  <div class="side">
    <h2 id="top-caption"></h2>
    <table id="top"></table>
    <h2>mean of the selected heads (rows: tokens, columns: what they attend to)</h2>
    <canvas id="matrix"></canvas>
  </div>
</div>
<script id="qkv-data" type="application/json">{data}</script>
<script>{script}</script>
</body>
</html>
"""


def _json_for_script(obj: Any) -> str:
    """JSON that cannot close its <script> element or start markup inside it."""
    s = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _quantise(weights: torch.Tensor) -> str:
    """``[layers, heads, L, L]`` weights as base64 little-endian uint16 (value x 65535):
    4 significant decimals at 2 bytes per weight, so long texts stay a few MB."""
    q = (weights.float().clamp(0, 1) * 65535).round().to(torch.int32).numpy().astype("<u2")
    return base64.b64encode(q.tobytes()).decode("ascii")


def _asset(name: str) -> str:
    return resources.files("qkv.viz").joinpath(name).read_text(encoding="utf-8")


def render(
    maps: AttentionMaps,
    *,
    focus: int | None = None,
    layer: int | None = None,
    head: int | None = None,
    top: int = 5,
) -> str:
    """The page as a string: open at ``layer`` (default 0) with ``head`` (default: all heads)
    selected and token ``focus`` pinned."""
    script = _asset("_page.js")
    digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii")
    data = {
        "tokens": maps.tokens,
        "layers": maps.n_layers,
        "heads": maps.n_heads,
        "focus": focus,
        "layer": 0 if layer is None else layer,
        "head": head,
        "top": top,
        "weights": _quantise(maps.weights),
    }
    meta = (
        f"{maps.model}: {maps.n_layers} layers × {maps.n_heads} heads, {len(maps.tokens)} tokens. "
        "Lines join each token (left) to the tokens it attends to (right); opacity = weight, "
        "one colour per head. Hover or click a token; click a head to toggle it, double-click "
        "to show it alone."
    )
    return _TEMPLATE.format(
        script_hash=f"sha256-{digest}",
        title=html.escape(maps.text[:80]),
        css=_asset("_page.css"),
        text=html.escape(maps.text),
        meta=html.escape(meta),
        data=_json_for_script(data),
        script=script,
    )
