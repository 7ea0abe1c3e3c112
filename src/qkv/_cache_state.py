"""What makes a KV cache state rather than scratch: the key that names its layer, the guard
that lets one step in at a time, and saving and copying (``pickle``, ``torch.save``,
``copy.deepcopy``)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from threading import get_ident
from typing import Any

import torch

__all__ = ["LayerKey", "StepGuard"]


class LayerKey:
    """What stands for an attention layer in its caches: the layer holds its key (strongly),
    a cache holds its owner's key weakly while decoding.

    Not the layer itself, so that saving or copying a cache does not drag its layer along: a
    cache's pickled (and deep-copied) state holds the key *strongly* (a key is an empty object),
    and loading turns it back into a weak reference. Saved or copied together with the layer
    (one ``pickle.dumps`` / ``torch.save`` / ``copy.deepcopy`` call), the two share one copy of
    the key (pickle's memo), so the loaded cache belongs to the loaded layer, whatever their
    order. Saved alone, the loaded key is held by no layer and dies at once: the cache is
    unowned, as after ``reset()``."""

    __slots__ = ("__weakref__",)

    def __reduce__(self) -> tuple[type[LayerKey], tuple[()]]:
        return (LayerKey, ())


class StepGuard:
    """One step at a time, and a state that saves and copies.

    The guard is held from the start of a layer's step (``_enter``) to its end
    (``_end_step``): taken without waiting, so a second step that comes in meanwhile (another
    thread, or a mask_mod calling the layer again) raises instead of interleaving its writes.
    It costs one uncontended lock acquire and release a step."""

    _owner: weakref.ref[Any] | None  # the owner layer's LayerKey

    def _init_guard(self) -> None:
        self._busy = threading.Lock()
        self._stepper = 0  # get_ident() of the thread inside the step, for the error

    def _enter(self, what: str) -> None:
        """Take the guard for this thread, or raise: ``what`` the caller was about to do.
        Not while dynamo traces: a lock is not traceable, and a compiled step runs whole."""
        if torch.compiler.is_compiling():
            return
        if not self._busy.acquire(blocking=False):
            self._refuse(what)
        self._stepper = get_ident()

    def _end_step(self) -> None:
        """The step that was let in is over, done or failed."""
        if not torch.compiler.is_compiling():
            self._busy.release()

    @contextmanager
    def _claimed(self, what: str) -> Iterator[None]:
        """The guard for one change outside a step (reset, truncate, saving)."""
        self._enter(what)
        try:
            yield
        finally:
            self._end_step()

    def _refuse(self, what: str) -> None:
        name, holder, me = type(self).__name__, self._stepper, get_ident()
        if holder == me:
            raise RuntimeError(
                f"this {name} is already inside a step in this thread, so it cannot {what} "
                f"until that step returns: a step that calls a layer with the cache it is "
                f"filling (from a mask_mod, score_mod or hook?) would interleave two steps; "
                f"use another cache for the inner call"
            )
        threads = {t.ident: t.name for t in threading.enumerate()}
        raise RuntimeError(
            f"this {name} ({self!r}) is inside a step in thread "
            f"{threads.get(holder, holder)!r}, so it cannot {what} from thread "
            f"{threads.get(me, me)!r} now: a cache belongs to one decoding stream at a time "
            f"(two threads at once would overwrite each other's tokens); give each thread its "
            f"own cache (copy.deepcopy one to branch a sequence), or wait for the step to return"
        )

    def __getstate__(self) -> dict[str, Any]:
        # A lock does not pickle, and a weakref neither: the owner's key goes in strongly (see
        # LayerKey), and a cache in the middle of a step is refused rather than saved half
        # written.
        with self._claimed("be saved or copied"):
            state = self.__dict__.copy()
        del state["_busy"], state["_stepper"]
        state["_owner"] = self._owner() if self._owner is not None else None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        owner = state.pop("_owner")
        self.__dict__.update(state)
        self._owner = weakref.ref(owner) if owner is not None else None
        self._init_guard()
