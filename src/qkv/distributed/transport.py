"""Point-to-point transport on ``torch.distributed``: ``isend``/``irecv`` of packed key/value
rows (and of dK/dV partial sums in the backward), and a record of what moved.

Every message is one contiguous tensor ``[B, Hkv, rows, D + Dv]`` (keys and values of the
pieces a step names, side by side), so a step costs one send and one receive per rank.
``with qd.traffic() as t:`` records each message (phase, peer, bytes) and the seconds spent
waiting for receives versus computing, which is how the tests count neighbour-only traffic
and the benchmark measures overlap.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

Tensor = torch.Tensor


@dataclass
class Traffic:
    """What moved while recording: ``sent[(phase, peer)]`` and ``received[(phase, peer)]``
    in bytes (``phase`` is ``"forward"`` or ``"backward"``; ``peer`` a rank of the group),
    ``wait_s`` blocked in receives of keys/values, ``grad_wait_s`` in receives of dK/dV
    partial sums (which also waits for the peer to finish computing them), ``compute_s`` in
    attention calls."""

    sent: dict[tuple[str, int], int] = field(default_factory=lambda: defaultdict(int))
    received: dict[tuple[str, int], int] = field(default_factory=lambda: defaultdict(int))
    messages: int = 0
    wait_s: float = 0.0
    grad_wait_s: float = 0.0
    compute_s: float = 0.0

    def peers(self) -> set[int]:
        return {p for _, p in self.sent} | {p for _, p in self.received}

    def total(self, phase: str | None = None) -> tuple[int, int]:
        """``(bytes sent, bytes received)``, over one phase or both."""

        def s(d: dict[tuple[str, int], int]) -> int:
            return sum(n for (ph, _), n in d.items() if phase is None or ph == phase)

        return s(self.sent), s(self.received)


_recording: list[Traffic] = []


@contextmanager
def traffic() -> Iterator[Traffic]:
    """Record every message ``qd.attention`` sends or receives on this rank inside the block."""
    t = Traffic()
    _recording.append(t)
    try:
        yield t
    finally:
        _recording.remove(t)


def _note(kind: str, phase: str, peer: int, nbytes: int) -> None:
    for t in _recording:
        (t.sent if kind == "sent" else t.received)[(phase, peer)] += nbytes
        t.messages += 1


def note_time(wait: float = 0.0, compute: float = 0.0, grad_wait: float = 0.0) -> None:
    for t in _recording:
        t.wait_s += wait
        t.grad_wait_s += grad_wait
        t.compute_s += compute


class Pending:
    """A posted receive: ``wait()`` gives its tensor."""

    def __init__(self, work: Any, buf: Tensor, grads: bool) -> None:
        self.work, self.buf, self.grads = work, buf, grads

    def wait(self) -> Tensor:
        t0 = time.perf_counter()
        if self.work is not None:
            self.work.wait()
        dt = time.perf_counter() - t0
        if self.grads:
            note_time(grad_wait=dt)
        else:
            note_time(wait=dt)
        return self.buf


Send = tuple[Tensor, int, int]  # (tensor, peer, tag)
Recv = tuple[tuple[int, ...], torch.dtype, torch.device, int, int]  # (shape, ..., peer, tag)


class Exchange:
    """The messages of one call on one rank, in one phase; ``finish()`` waits for its sends.

    Each ``post`` is one ``batch_isend_irecv``: a step's send and receive go out together,
    which NCCL needs (its point-to-point calls outside one group run in order on one stream,
    so a ring of lone sends would wait for receives queued behind them); gloo takes it too.
    """

    def __init__(self, group: Any, phase: str) -> None:
        self.group, self.phase = group, phase
        self.sends: list[tuple[Any, Tensor]] = []

    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def post(
        self, sends: Sequence[Send], recvs: Sequence[Recv], *, grads: bool = False
    ) -> list[Pending]:
        """Post ``sends`` and ``recvs`` as one batch; the receives' handles, in order."""
        ops, kept, bufs = [], [], []
        for t, peer, tag in sends:
            t = t.contiguous()  # the tensor must outlive the send
            ops.append(dist.P2POp(dist.isend, t, self._global(peer), self.group, tag))
            kept.append(t)
            _note("sent", self.phase, peer, t.numel() * t.element_size())
        for shape, dtype, device, peer, tag in recvs:
            buf = torch.empty(shape, dtype=dtype, device=device)
            ops.append(dist.P2POp(dist.irecv, buf, self._global(peer), self.group, tag))
            bufs.append(buf)
            _note("received", self.phase, peer, buf.numel() * buf.element_size())
        works = dist.batch_isend_irecv(ops) if ops else []
        self.sends += list(zip(works[: len(sends)], kept, strict=True))
        return [Pending(w, b, grads) for w, b in zip(works[len(sends) :], bufs, strict=True)]

    def finish(self) -> None:
        for work, _ in self.sends:
            if work is not None:
                work.wait()
        self.sends.clear()
