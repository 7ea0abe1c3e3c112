"""A call's signature: everything its decision reads, as one hashable value.

Two calls with equal signatures are checked and decided the same way, so the planner keeps a
plan under its signature (:func:`qkv.planner.decide`) and :func:`qkv.attention` runs a repeat
call's plan without checking or deciding again.

What a signature holds:

- the shapes of ``q``, ``k``, ``v`` as the problem has them (``[B, H, L, D]``), their dtypes
  and devices, which of them (and a bias) need a gradient;
- the mask and the score as *tokens* (``qkv._core.kindspec.mask_token``, ``score_token``): a
  built-in mask or score by its value (``value_token``: its class and numbers, so one made
  anew at each call is the same signature; ``qkv.causal`` and ``qkv.sliding_window`` hold
  only numbers and are their own tokens), each tensor in it (document ids, padding lengths,
  ALiBi slopes) and a bias tensor by identity and version counter, held weakly (an in-place
  edit of the ids or lengths is a new signature; a freed tensor's token equals nothing made
  later); a user's score_mod weakly (the decision reads its kind, not its values);
- the scale, dropout, ``return_lse``, the input's number of dims, the backend asked for;
- the environment the decision reads: ``QKV_NATIVE``, the dense-memory limit, the number of
  threads.

A mask whose values cannot be watched (a user's mask_mod and the tensors it closes over, a
bool mask tensor, a block mask) is in a signature as an ``Unwatched`` token (the mod weakly,
the tensor by its shape, the block mask weakly): its decision is kept, but the backend plans
its tiles again at every call and no runner is kept; a repeat call goes through the checks.
A callable that takes no weak reference, or an inference tensor, makes no signature: such
calls are decided every time.
Under torch.compile nothing is kept: dynamo traces the decision once per graph.

Decisions that read the logits (whether ``|q|·|k|·scale`` may pass the precision limit of a
recomputing backward, asked only when a gradient is needed) are kept per answer: the planner
stores them under ``(signature, answer)``.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch

from .._core.checks import default_scale
from .._core.kindspec import Unwatched, mask_token, problem_mask_token, score_token
from .._core.problem import Problem

Tensor = torch.Tensor

_NONE = ()  # the token of no mask, of no score


class Signature(NamedTuple):
    """One call, as its decision sees it (see the module docstring)."""

    q: tuple[int, ...]  # [B, Hq, Lq, D]
    k: tuple[int, ...]  # [B, Hkv, Lk, D]
    v: tuple[int, ...]  # [B, Hkv, Lk, Dv]
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype]
    devices: tuple[torch.device, torch.device, torch.device]
    grads: tuple[bool, bool, bool, bool]  # q, k, v and a bias need a gradient
    mask: object  # a token (see mask_token)
    score: object  # a token (see score_token)
    scale: float
    dropout_p: float
    return_lse: bool
    ndim: int  # the dims of the input (2, 3 or 4)
    backend: object  # as asked for
    env: tuple[object, ...]  # QKV_NATIVE, the dense limit, threads


def of_problem(p: Problem, backend: object, dense_limit: int) -> Signature | None:
    """The signature of a validated problem, or ``None`` when its decision reads values that
    cannot be watched (see the module docstring)."""
    if torch.compiler.is_compiling():
        return None
    mask = problem_mask_token(p.mask)
    score = score_token(None if p.score.is_none else p.score.source)
    if mask is None or score is None:
        return None
    grad = torch.is_grad_enabled()
    bias = p.score.bias
    return Signature(
        p.q.shape, p.k.shape, p.v.shape,
        (p.q.dtype, p.k.dtype, p.v.dtype), (p.q.device, p.k.device, p.v.device),
        (grad and p.q.requires_grad, grad and p.k.requires_grad, grad and p.v.requires_grad,
         grad and bias is not None and bias.requires_grad),
        mask, score, p.scale, p.dropout_p, p.return_lse, p.orig_ndim, backend,
        (native_setting(), dense_limit, torch.get_num_threads()),
    )  # fmt: skip


def of_call(
    q: object,
    k: object,
    v: object,
    mask: object,
    scale: object,
    return_lse: bool,
    backend: object,
    dense_limit: int,
) -> tuple[object, ...] | None:
    """The signature of a call with 4-D tensors, no score_mod and no dropout, from its
    arguments as given (no checks: the planner keeps plans only for signatures a validated
    call had, so a signature found there is one the checks accepted). ``None`` for anything
    else; the caller then validates."""
    if not (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor):
        return None  # subclasses and non-tensors take the full path (and its errors)
    qs = q.shape
    if len(qs) != 4 or torch.compiler.is_compiling():
        return None
    if scale is None:
        scale = _DEFAULT_SCALE.get(qs[3]) or _default_scale(qs[3])
    elif type(scale) is not float or not math.isfinite(scale):
        return None
    if mask is None:
        token: object = _NONE
    else:
        token = mask_token(mask)
        if token is None or isinstance(token, Unwatched):
            return None  # (a kept runner would reuse values of the mask that may have changed)
    grad = torch.is_grad_enabled()
    # A plain tuple in Signature's order: equal to the Signature of_problem makes, with the
    # same hash, and ~0.4 us cheaper to make (a decode step makes one per call).
    return (
        qs, k.shape, v.shape, (q.dtype, k.dtype, v.dtype), (q.device, k.device, v.device),
        (grad and q.requires_grad, grad and k.requires_grad, grad and v.requires_grad, False),
        token, _NONE, scale, 0.0, return_lse, 4, backend,
        (native_setting(), dense_limit, torch.get_num_threads()),
    )  # fmt: skip


SCALE = Signature._fields.index("scale")  # (of_call's plain tuples are read by position)


_DEFAULT_SCALE: dict[int, float] = {}


def _default_scale(D: int) -> float:
    """The scale the checks make of ``None`` (remembered per head dim: ~0.3 us a call)."""
    scale = _DEFAULT_SCALE[D] = default_scale(D)
    return scale


# os.environ.get costs ~1 us a call (it encodes the key), as much as the rest of a signature;
# on POSIX its backing dict of bytes is read in ~30 ns, and stays in step with it (setenv,
# monkeypatch.setenv and os.environ[...] = ... all write there).
_ENV_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None


def native_setting() -> object:
    """``QKV_NATIVE`` as the planner will read it (it decides whether compiled kernels run)."""
    if _ENV_DATA is not None:
        return _ENV_DATA.get(b"QKV_NATIVE")
    return os.environ.get("QKV_NATIVE")
