"""Documentation that runs: the README's and every docs page's Python blocks, and the docstring
examples. (The built site itself is checked in test_docs_site.py.)"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import qkv

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# Pages whose blocks load real checkpoints (seconds each): still run, marked slow so a quick
# local run can leave them out with -m 'not slow'.
SLOW_PAGES = {
    "from-formula-to-kernel.md",
    "tutorial/real-models.md",
    "guides/models.md",
    "guides/hf.md",
    "guides/inspect.md",
    "guides/compile.md",
    "cross-attention.md",
}


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def readme_blocks() -> list[str]:
    return python_blocks((ROOT / "README.md").read_text())


def test_readme_has_python_examples():
    assert readme_blocks(), "the README should show runnable Python"


@pytest.mark.parametrize("index", range(len(readme_blocks())))
def test_readme_python_block_runs(index):
    exec(compile(readme_blocks()[index], f"README.md[block {index}]", "exec"), {})


def docs_pages() -> list[str]:
    """Every Markdown page of the site, as a path under docs/ (hooks' folders left out)."""
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    return [p for p in pages if not any(part.startswith("_") for part in p.split("/"))]


def _page_param(page: str) -> object:
    return pytest.param(page, marks=pytest.mark.slow) if page in SLOW_PAGES else page


@pytest.mark.parametrize("page", [_page_param(p) for p in docs_pages()])
def test_docs_pages_run_in_order(page):
    """Each page is one story: its blocks run in order in one namespace."""
    blocks = python_blocks((DOCS / page).read_text())
    ns: dict[str, object] = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/{page}[block {i}]", "exec"), ns)


def test_the_tutorial_and_the_guides_show_runnable_python():
    """Reference and contributing pages may be prose and tables; a lesson or a guide runs."""
    for page in docs_pages():
        if page.startswith(("tutorial/", "guides/")) or "/" not in page:
            if page == "guides/performance.md":  # plots of recorded results
                continue
            assert python_blocks((DOCS / page).read_text()), f"docs/{page} has no runnable example"


def test_slow_pages_exist():
    missing = SLOW_PAGES - set(docs_pages())
    assert not missing, missing


def _modules():
    names = ["qkv"]
    for m in pkgutil.walk_packages(qkv.__path__, "qkv."):
        names.append(m.name)
    return names


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name, globs={}):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"


def test_every_public_name_is_documented():
    for name in qkv.__all__:
        obj = getattr(qkv, name)
        if name.startswith("__"):
            continue
        assert (getattr(obj, "__doc__", None) or "").strip(), f"qkv.{name} has no docstring"
