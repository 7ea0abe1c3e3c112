"""The documentation site, built once per session with ``mkdocs build --strict``.

A broken link or anchor, a page missing from the navigation, or a docstring griffe cannot read
fails the build. Then: every public name has a docstring that states its shapes and an entry in
the API reference, and the built site works in headless Chromium with no network: the home page
renders from the file system, the search box finds ``sliding_window`` (the site served from
127.0.0.1), and the ``qkv.attention`` entry shows its signature.

Browser policy as in test_viz_html.py: without a browser these tests fail; outside CI
(``CI`` unset) ``QKV_SKIP_BROWSER=1`` skips them.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import qkv
from _chromium import Chromium, started

ROOT = Path(__file__).resolve().parents[1]
MKDOCS = Path(sys.executable).with_name("mkdocs")

# The public surface the reference documents: each module's __all__.
MODULES = ("qkv", "qkv.inspect", "qkv.models", "qkv.hf", "qkv.distributed")

# Public names that take and return no tensor, so have no shape to state (each says why).
NO_TENSORS = {
    "qkv.__version__": "a version string",
    "qkv.set_dense_limit": "a byte count",
    "qkv.Plan": "a decision: backend, kernels, costs; holds no tensors",
    "qkv.models.MODEL_NAMES": "model names",
    "qkv.models.BertConfig": "numbers from config.json",
    "qkv.models.LlamaConfig": "numbers from config.json",
    "qkv.models.PoolingConfig": "pooling options",
    "qkv.models.GenerationStats": "token counts and rates",
    "qkv.models.default_model_path": "a folder",
    "qkv.models.load": "returns a model; the models' own entries state their shapes",
    "qkv.hf.register": "a name in transformers' registries",
    "qkv.distributed.LAYOUTS": "layout names",
    "qkv.distributed.ContextParallel": "a process group and a layout",
    "qkv.distributed.Plan": "steps, bytes and FLOPs per rank",
    "qkv.distributed.RankPlan": "steps, bytes and FLOPs of one rank",
    "qkv.distributed.Step": "one exchange of the plan",
    "qkv.distributed.Traffic": "byte and message counts",
    "qkv.distributed.traffic": "counts what moved",
}

# Where griffe (reading the source) finds a name that a same-named submodule shadows:
# qkv.distributed.plan is the function re-exported from api.py, not the module plan.py.
SOURCE_PATH = {"qkv.distributed.plan": "qkv.distributed.api.plan"}

# A shape in a docstring: ``[B, Hq, Lq, D]``, ``[2R+1, H]``, ``[layers, heads, L, L]``.
_TOKEN = r"(?:[\w.][\w+*/|'.-]*|\.\.\.)"
SHAPE = re.compile(rf"(?<![\w\]])\[\s*{_TOKEN}(?:\s*,\s*{_TOKEN})*\s*\]")
DIMS = re.compile(
    r"\b(B|H|Hq|Hkv|L|Lq|Lk|L_local|D|Dv|d|d_model|n|N|W|K|R|vocab|dim|layers|heads|n_heads|"
    r"window|rows|\d+)\b"
)


# A page or stylesheet reaching outside the site (a CDN's fonts, scripts or styles).
ELSEWHERE = re.compile(
    r"""<(?:script|img|iframe|source|link)\b[^>]*\b(?:src|href)=["'](?:https?:)?//[^"']+"""
    r"""|url\(["']?(?:https?:)?//"""
)


def public_names() -> list[str]:
    import qkv.distributed
    import qkv.hf
    import qkv.inspect
    import qkv.models  # noqa: F401 (imported for sys.modules)

    names = []
    for mod in MODULES:
        for name in sys.modules[mod].__all__:
            names.append(f"{mod}.{name}")
    return names


def states_a_shape(doc: str) -> bool:
    return any(DIMS.search(m.group()) for m in SHAPE.finditer(doc))


def test_states_a_shape() -> None:
    assert states_a_shape("q: ``[B, Hq, Lq, D]``") and states_a_shape("``table [2R+1, H]``")
    assert states_a_shape("torch.Size([2, 384])") and states_a_shape("``[layers, heads, L, L]``")
    assert not states_a_shape("``rec[0]`` and ``[start, stop)``") and not states_a_shape("[CLS]")


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built into a temporary folder (about 10 s on a 2-core machine)."""
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stderr[-6000:]}"
    return out


def test_the_site_builds_strictly_with_every_page(site: Path) -> None:
    pages = {
        p.relative_to(ROOT / "docs").with_suffix(".html").as_posix()
        for p in (ROOT / "docs").rglob("*.md")
        if "_hooks" not in p.parts
    }
    missing = [p for p in sorted(pages) if not (site / p).is_file()]
    assert not missing, missing
    plots = sorted(p.name for p in (site / "guides" / "plots").glob("*.svg"))
    assert plots == ["decode.svg", "hf.svg", "models.svg", "sweep.svg", "train.svg"], plots
    assert all((site / "guides" / "plots" / p).stat().st_size > 10_000 for p in plots)
    page = (site / "guides" / "performance.html").read_text(encoding="utf-8")
    assert all(f'src="plots/{p}"' in page for p in plots)


def test_nothing_is_fetched_from_elsewhere(site: Path) -> None:
    """No page or stylesheet loads anything from outside the site: no fonts, scripts, images or
    styles from a CDN (links a reader may follow are fine)."""
    found = []
    for path in site.rglob("*"):
        if path.suffix in (".html", ".css") and path.name != "sitemap.xml":
            text = path.read_text(encoding="utf-8", errors="replace")
            for m in re.finditer(ELSEWHERE, text):
                found.append(f"{path.relative_to(site)}: {m.group()[:100]}")
    assert not found, "\n".join(found[:20])


def test_every_public_name_is_in_the_reference(site: Path) -> None:
    ids: set[str] = set()
    for page in (site / "reference").glob("*.html"):
        ids |= set(re.findall(r'id="(qkv[\w.]*)"', page.read_text(encoding="utf-8")))
    missing = [n for n in public_names() if n not in ids]
    assert not missing, f"public names without an entry in docs/reference/: {missing}"


@pytest.fixture(scope="module")
def source_docs() -> object:
    """qkv as the site reads it: griffe on the source, with the site's extension."""
    import griffe

    sys.path.insert(0, str(ROOT / "docs" / "_hooks"))
    try:
        from runtime_docstrings import RuntimeDocstrings
    finally:
        sys.path.pop(0)
    return griffe.load(
        "qkv",
        search_paths=[str(ROOT / "src")],
        extensions=griffe.Extensions(RuntimeDocstrings()),
        docstring_parser="google",
    )


def test_every_public_name_has_a_docstring_that_states_its_shapes(source_docs: object) -> None:
    assert set(NO_TENSORS) <= set(public_names()), set(NO_TENSORS) - set(public_names())
    no_doc, no_shape = [], []
    for name in public_names():
        path = SOURCE_PATH.get(name, name)
        obj = source_docs.get_member(path.split(".", 1)[1])  # type: ignore[attr-defined]
        doc = obj.docstring.value if obj.docstring else ""
        if not doc.strip():
            if name != "qkv.__version__":
                no_doc.append(name)
        elif obj.kind.value != "module" and name not in NO_TENSORS and not states_a_shape(doc):
            no_shape.append(name)
    assert not no_doc, f"public names without a docstring: {no_doc}"
    assert not no_shape, f"docstrings that state no shape ([B, H, L, D] ...): {no_shape}"


# ------------------------------------------------------------------------------ the browser


@pytest.fixture(scope="module")
def browser() -> Iterator[Chromium]:
    yield from started()


def _requests(b: Chromium) -> list[str]:
    return [
        ev["params"]["request"]["url"]
        for ev in b.events
        if ev.get("method") == "Network.requestWillBeSent"
    ]


def _poll(b: Chromium, expression: str, timeout: float = 20.0) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = b.eval(expression)
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def test_home_page_renders_offline(site: Path, browser: Chromium) -> None:
    browser.open((site / "index.html").as_uri())
    assert "attention for PyTorch" in browser.eval("document.querySelector('h1').textContent")
    links = browser.eval("[...document.querySelectorAll('nav a')].map(a => a.textContent)")
    assert any("Attention from scratch" in t for t in links), links
    height = browser.eval("document.querySelector('.md-content').getBoundingClientRect().height")
    assert height > 300
    assert not browser.problems(), browser.problems()
    elsewhere = [u for u in _requests(browser) if not u.startswith(("file:", "data:", "blob:"))]
    assert not elsewhere, elsewhere


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """The site over HTTP on 127.0.0.1 (what `python -m http.server -d site` does): the search
    runs in a web worker, which a page opened from the file system did not start in headless
    Chromium (Material's file:// shim stayed at "Initializing search")."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def test_search_finds_sliding_window_offline(served: str, browser: Chromium) -> None:
    browser.open(f"{served}/index.html")
    browser.eval(
        "(() => { const i = document.querySelector('input.md-search__input'); i.focus();"
        " i.value = 'sliding_window';"
        " i.dispatchEvent(new Event('input', {bubbles: true}));"
        " i.dispatchEvent(new KeyboardEvent('keyup', {bubbles: true, key: 'w'})); })()"
    )
    hits = _poll(
        browser,
        "[...document.querySelectorAll('.md-search-result__item a')].map(a => a.href)",
    )
    assert hits, "the search box found nothing for sliding_window"
    assert any("reference/masks.html" in h for h in hits), hits  # type: ignore[union-attr]
    local = (served, "data:", "blob:")
    elsewhere = [u for u in _requests(browser) if not u.startswith(local)]
    assert not elsewhere, elsewhere
    assert not browser.problems(), browser.problems()


def test_reference_shows_the_signature_of_attention(site: Path, browser: Chromium) -> None:
    browser.open((site / "reference" / "attention.html").as_uri() + "#qkv.attention")
    signature = browser.eval(
        "document.getElementById('qkv.attention').closest('.doc-object')"
        ".querySelector('.doc-signature').innerText"
    )
    flat = " ".join(signature.split())
    for part in ("attention(", "q: Tensor", "mask: MaskLike = None", "return_lse: bool = False"):
        assert part in flat, (part, flat)
    text = browser.eval("document.querySelector('.md-content').innerText")
    assert "[B, Hq, Lq, D]" in text and "Parameters" in text
    assert not browser.problems(), browser.problems()


def test_role_links_point_into_the_reference(site: Path) -> None:
    """``:func:`qkv.plan``` in a docstring became a link to qkv.plan's entry."""
    page = (site / "reference" / "attention.html").read_text(encoding="utf-8")
    assert ":func:" not in page and ":class:" not in page
    assert 'href="attention.html#qkv.plan"' in page or 'href="#qkv.plan"' in page
    assert qkv.attention.__doc__ and ":func:`qkv.plan`" in qkv.attention.__doc__
