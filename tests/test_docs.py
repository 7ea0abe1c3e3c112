"""Documentation that runs: the README's Python blocks and the docstring examples."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import qkv

ROOT = Path(__file__).resolve().parents[1]


def readme_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_has_python_examples():
    assert readme_blocks(), "the README should show runnable Python"


@pytest.mark.parametrize("index", range(len(readme_blocks())))
def test_readme_python_block_runs(index):
    exec(compile(readme_blocks()[index], f"README.md[block {index}]", "exec"), {})


DOCS = sorted((ROOT / "docs").glob("*.md"))


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_docs_pages_run_in_order(page):
    """Each docs/ page is one story: its blocks run in order in one namespace."""
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    assert blocks, f"{page.name} has no runnable example"
    ns: dict[str, object] = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{page.name}[block {i}]", "exec"), ns)


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
