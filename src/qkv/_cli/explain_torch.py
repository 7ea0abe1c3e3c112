"""``qkv explain --torch-model module:factory``: what a PyTorch model built elsewhere attends to.

``factory()`` (a function in an importable module) returns ``(model, inputs)``: an
``nn.Module`` and its example input (a tensor, a tuple of positional arguments, or a dict of
keyword arguments). The model runs once under :func:`qkv.override_sdpa` and
:func:`qkv.inspect.record`, so each of its ``F.scaled_dot_product_attention`` calls runs on
qkv and is recorded, named by the module that made it. For each call the command prints the
shapes, the mask as qkv read it, and the keys the chosen query row attends to most (the
weights rebuilt from the call's log-sum-exp, averaged over heads, first batch element).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path
from typing import Any

import torch


class Refused(ValueError):
    """A user error: one line, exit status 2 (``qkv explain`` prints a ValueError's message)."""


def load(spec: str) -> tuple[torch.nn.Module, Any]:
    """Import ``module:factory`` (the current folder is importable) and call the factory."""
    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name:
        raise Refused(
            f"--torch-model {spec!r}: give module:factory, e.g. mymodels:tiny_gpt, where "
            f"factory() returns (model, inputs)"
        )
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        raise Refused(f"--torch-model {spec!r}: cannot import {mod_name!r} ({e})") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise Refused(f"--torch-model {spec!r}: {mod_name} has no function {fn_name!r}")
    got = fn()
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], torch.nn.Module)):
        raise Refused(
            f"--torch-model {spec!r}: {fn_name}() must return (model, inputs) with an "
            f"nn.Module first, got {type(got).__name__}"
        )
    return got[0], got[1]


def _mask_name(mask: object) -> str:
    if mask is None:
        return "none"
    if isinstance(mask, torch.Tensor):
        return f"{str(mask.dtype).replace('torch.', '')} tensor {list(mask.shape)}"
    return str(mask)


def _row(want: str | None, lq: int) -> int:
    if want is None:
        return lq - 1
    if not re.fullmatch(r"#\d+", want) or int(want[1:]) >= lq:
        raise Refused(f"--token {want!r}: give #N with N < {lq} (the query rows of a call)")
    return int(want[1:])


def run_torch(args: argparse.Namespace) -> int:
    import qkv

    if args.top < 1:
        raise Refused(f"--top must be at least 1, got {args.top}")
    model, inputs = load(args.torch_model)
    model.eval()
    with torch.no_grad(), qkv.override_sdpa(), qkv.inspect.record(model) as rec:
        if isinstance(inputs, dict):
            model(**inputs)
        elif isinstance(inputs, tuple):
            model(*inputs)
        else:
            model(inputs)
    if not len(rec):
        print(
            f"{args.torch_model}: the model made no torch.nn.functional."
            f"scaled_dot_product_attention call that qkv could see"
        )
        return 0
    print(f"{args.torch_model}: {len(rec)} attention calls on qkv")
    for i, cap in enumerate(rec):
        assert cap.q is not None and cap.k is not None
        b, h, lq, d = cap.q.shape
        row = _row(args.token, lq)
        w = cap.weights(rows=[row])[0, :, 0].float().mean(0)  # [Lk]: mean over heads
        top = w.topk(min(args.top, w.numel()))
        keys = ", ".join(
            f"{j}:{p:.2f}" for p, j in zip(top.values.tolist(), top.indices.tolist(), strict=True)
        )
        name = cap.layer or "(the model)"
        print(
            f"{i:3d} {name}  q [{b}, {h}, {lq}, {d}]  k {list(cap.k.shape)}  "
            f"mask {_mask_name(cap.mask)}  row {row} -> {keys}"
        )
    return 0
