"""The ``qkv explain --html`` page in a real headless Chromium.

The page must load with no console error, show the tokens as text (hostile ones included),
change when the layer or head changes, make no network request, and render something visible.

Browser policy (docs/contributing/testing.md, "In a browser"): ``make test`` installs
Chromium when it is missing and it runs as root (as CI does). If no browser can be found or
started, these tests FAIL. The only way to skip them is to set ``QKV_SKIP_BROWSER=1`` on a
machine where ``CI`` is not set; in CI that variable is ignored.
"""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from _chromium import Chromium, started
from qkv.viz import AttentionMaps, html

HOSTILE = "<script>alert(1)</script> <img src=x onerror=alert(1)> The cat sat because it was tired."
QKV = str(Path(sys.executable).with_name("qkv"))


@pytest.fixture(scope="module")
def browser() -> Iterator[Chromium]:
    yield from started()


@pytest.fixture(scope="module")
def cli_page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The page `qkv explain` writes for a hostile text, through the installed console script."""
    out = tmp_path_factory.mktemp("html") / "explain.html"
    r = subprocess.run(
        [QKV, "explain", HOSTILE, "--html", str(out)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return out


def _signature(b: Chromium) -> str:
    """Everything the head view and the side panel currently draw."""
    return b.eval(
        "[...document.querySelectorAll('#view line.attn')].map(l => "
        "[l.getAttribute('y1'), l.getAttribute('y2'), l.getAttribute('stroke'), "
        "l.getAttribute('stroke-opacity')].join()).join(';') + '|' + "
        "document.getElementById('top').textContent"
    )


def _network_urls(b: Chromium) -> list[str]:
    return [
        ev["params"]["request"]["url"]
        for ev in b.events
        if ev.get("method") == "Network.requestWillBeSent"
    ]


def _assert_visible(png: bytes, path: Path) -> None:
    import matplotlib.image

    path.write_bytes(png)  # kept for a person to look at: pytest's tmp dir
    img = matplotlib.image.imread(io.BytesIO(png))  # [H, W, 3 or 4] floats in [0, 1]
    rgb = torch.from_numpy(img[..., :3].copy())
    non_white = (rgb < 0.95).any(-1).float().mean().item()
    colours = len({tuple(p) for p in (rgb[::7, ::7] * 255).round().int().reshape(-1, 3).tolist()})
    assert img.shape[0] >= 500 and img.shape[1] >= 800
    assert non_white > 0.01, f"screenshot is almost blank ({non_white:.2%} non-white)"
    assert colours > 20, f"screenshot has only {colours} colours"


def test_cli_page_loads_renders_and_switches(
    browser: Chromium, cli_page: Path, tmp_path: Path
) -> None:
    page = cli_page.read_text(encoding="utf-8")
    # Escaped in the file: the hostile text never appears as markup.
    assert "<script>alert" not in page and "<img" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    browser.open(cli_page.as_uri())
    assert browser.problems() == []
    tokens = browser.eval(
        "[...document.querySelectorAll('#view .tok-left')].map(e => e.textContent)"
    )
    assert tokens[:4] == ["[CLS]", "<", "script", ">"]  # BERT splits the tags into pieces
    assert "it" in tokens and tokens[-1] == "[SEP]"
    assert browser.eval("document.querySelector('.text').textContent") == HOSTILE
    assert browser.eval("document.querySelectorAll('img').length") == 0
    assert browser.eval("document.querySelectorAll('script').length") == 2  # data + page script
    assert browser.eval("document.querySelectorAll('#layer option').length") == 6
    assert browser.eval("document.querySelectorAll('.head-chip').length") == 12
    focus = browser.eval("document.querySelector('#view .tok-left.active').textContent")
    assert focus == "it"  # the default --token is pinned

    before = _signature(browser)
    assert browser.eval("document.querySelectorAll('#view line.attn').length") > 0
    browser.eval("const s = document.getElementById('layer'); s.value = '4'; "
                 "s.dispatchEvent(new Event('change'))")  # fmt: skip
    after_layer = _signature(browser)
    assert after_layer != before
    assert browser.eval("window.qkvView.state.layer") == 4
    browser.eval(
        "document.querySelector('.head-chip[data-head=\"11\"]')"
        ".dispatchEvent(new MouseEvent('dblclick'))"
    )
    after_head = _signature(browser)
    assert after_head != after_layer
    assert browser.eval("[...window.qkvView.state.heads]") == [11]
    assert "head 11" in browser.eval("document.getElementById('top-caption').textContent")
    _assert_visible(browser.screenshot(), tmp_path / "explain-html.png")
    assert browser.problems() == []
    assert all(u.startswith(("file:", "data:")) for u in _network_urls(browser))


def test_hostile_tokens_are_text_not_markup(browser: Chromium, tmp_path: Path) -> None:
    """Tokens that *are* tags (a tokenizer could produce them) still show as plain text."""
    tokens = [
        "[CLS]",
        "<script>alert(1)</script>",
        "</script><b>x",
        "<img src=x onerror=alert(1)>",
        "&amp;",
        "it",
    ]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2, 3, 6, 6, generator=g).mul(3).softmax(-1)  # [layers, heads, L, L]
    maps = AttentionMaps(tokens, w, text="</p><script>alert(2)</script>", model="<b>m</b>")
    path = tmp_path / "hostile.html"
    path.write_text(html.render(maps, focus=5, layer=1, head=2), encoding="utf-8")
    page = path.read_text(encoding="utf-8")
    assert "<script>alert" not in page and "<img" not in page and "<b>" not in page
    browser.open(path.as_uri())
    assert browser.problems() == []  # an alert() would show here as a dialog
    shown = browser.eval(
        "[...document.querySelectorAll('#view .tok-right')].map(e => e.textContent)"
    )
    assert shown == tokens
    assert browser.eval("document.querySelectorAll('img, b').length") == 0
    assert browser.eval("window.qkvView.state.layer") == 1
    assert browser.eval("[...window.qkvView.state.heads]") == [2]
    # The weights survive the uint16 round trip to 4 decimals.
    got = browser.eval("window.qkvView.weight(1, 2, 5, 0)")
    assert abs(got - float(w[1, 2, 5, 0])) < 1e-4
    _assert_visible(browser.screenshot(), tmp_path / "hostile.png")
