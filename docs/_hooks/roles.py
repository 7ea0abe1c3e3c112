"""Sphinx roles in docstrings (``:func:`qkv.plan```) shown as links into the API reference.

qkv's docstrings are read by ``help()`` and by this site; they use Sphinx's roles, which
mkdocstrings' Markdown leaves as text (``:func:`` followed by the code). After a page is
rendered, each role is dropped and its code links to the reference entry of the name (or of
the nearest documented name above it: ``qkv.KVCache.reset`` links to ``qkv.KVCache``).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

ROLE = re.compile(r":(?:func|class|data|meth|attr|mod|exc|obj):(<code>([\w.]+)</code>)")
ENTRY = re.compile(r"^::: ([\w.]+)\s*$", flags=re.M)

_where: dict[str, str] = {}  # documented name -> its reference page (docs-relative URL)


def on_config(config: Any) -> None:
    _where.clear()
    for page in sorted((Path(config["docs_dir"]) / "reference").glob("*.md")):
        for name in ENTRY.findall(page.read_text(encoding="utf-8")):
            _where.setdefault(name, f"reference/{page.stem}.html")


def target(name: str) -> tuple[str, str] | None:
    """``(page, anchor)`` of ``name`` or of the closest documented name above it."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in _where:
            return _where[prefix], prefix
    return None


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    here = posixpath.dirname(page.file.url)

    def link(m: re.Match[str]) -> str:
        code, name = m.group(1), m.group(2)
        hit = target(name) or target(f"qkv.{name}")
        if hit is None:
            return code
        url = posixpath.relpath(hit[0], here or ".")
        return f'<a href="{url}#{hit[1]}">{code}</a>'

    # reST's "Example::" before a literal block: the block is already code here
    return ROLE.sub(link, html).replace("::</p>", ":</p>")
