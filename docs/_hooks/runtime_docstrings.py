"""A griffe extension: module attributes whose docstring is set at run time.

``qkv.causal`` is an instance, and its docstring is assigned to it after it is made
(``causal.__doc__ = ...``), which reading the source cannot see. For a module attribute with
no docstring in the source, this imports the module and takes the object's own ``__doc__``
(one set on the instance, not its class's). Only modules whose source assigns such a
docstring are imported.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import griffe


class RuntimeDocstrings(griffe.Extension):
    def on_attribute_instance(self, *, attr: griffe.Attribute, **kwargs: Any) -> None:
        if attr.docstring is not None or not attr.parent or not attr.parent.is_module:
            return
        path = attr.parent.filepath
        if isinstance(path, list) or f"{attr.name}.__doc__ =" not in path.read_text("utf-8"):
            return  # nothing assigns it a docstring: import nothing (qkv.hf pulls transformers)
        with contextlib.suppress(Exception):
            obj = getattr(importlib.import_module(attr.parent.path), attr.name)
            doc = vars(obj).get("__doc__") if hasattr(obj, "__dict__") else None
            if isinstance(doc, str) and doc.strip():
                attr.docstring = griffe.Docstring(doc, parent=attr)
