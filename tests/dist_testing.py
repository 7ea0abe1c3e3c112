"""Spawning a ``torch.distributed`` world for the tests: gloo on 127.0.0.1, a free port,
bounded timeouts, and no process outliving the call (each is killed on failure or timeout).

``run_world(W, target, *args)`` starts ``W`` processes running ``target(rank, W, port, out,
*args)``, each writing its results as JSON to ``out/rank{r}.json``, and returns them by rank.
A world is spawned once per world size and runs many cases, because starting one costs
seconds (each process imports torch and qkv).

Each rank's stdout and stderr go to ``out/rank{r}.log`` (with faulthandler on, so a crash in
C++ leaves the Python stack there too); when a rank dies, the error carries every rank's log.
A rank ends with ``finish``: its results written, a barrier, the group destroyed. A rank that
dies after every rank has written its results died in torch.distributed's teardown, not in a
case: that is a warning carrying the logs, and the results are read as usual. A world whose
ranks fail before every one of them has its group (``init_worker`` marks each rank ready) failed
in torch.distributed's setup (gloo aborts there at times, on a loaded machine: a connection
its peer has already dropped), before any qkv code ran: it is started once more, on a new
port, with a warning carrying the first attempt's logs.
"""

from __future__ import annotations

import faulthandler
import json
import os
import resource
import socket
import tempfile
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

# Generous for a loaded 2-core machine; a hang fails the test after this, never blocks it.
WORLD_TIMEOUT_S = 420.0
GROUP_TIMEOUT = timedelta(seconds=60)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# This rank's output folder (set by _rank_main in the spawned process).
_OUT: list[str] = []


def init_worker(rank: int, world_size: int, port: int) -> None:
    """Called first in every worker: one thread, loopback only, a bounded group timeout;
    the rank is marked ready once every rank has joined the group."""
    import torch
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=GROUP_TIMEOUT,
    )
    dist.barrier()
    mark_ready(rank)


def mark_ready(rank: int) -> None:
    (Path(_OUT[0]) / f"ready{rank}").touch()


def _rank_main(
    rank: int, target: Callable[..., None], world_size: int, port: int, out: str, *args: Any
) -> None:
    """A spawned rank: its output into ``out/rank{rank}.log``, then ``target``."""
    fd = os.open(Path(out) / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable(all_threads=True)
    _OUT.append(out)
    target(rank, world_size, port, out, *args)


def _logs(out: str, world_size: int, tail: int = 4000) -> str:
    parts = []
    for r in range(world_size):
        log = Path(out) / f"rank{r}.log"
        text = log.read_text(errors="replace") if log.exists() else "(no log)"
        parts.append(f"--- rank {r} (last {tail} characters) ---\n{text[-tail:]}")
    return "\n".join(parts)


def finish(out: str, rank: int, result: Any) -> None:
    """A rank's last step: write its results, wait for every rank, destroy the group."""
    import torch.distributed as dist

    path = Path(out) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)
    dist.barrier()
    dist.destroy_process_group()


def _abort() -> None:
    """SIGABRT, as gloo's aborts, without a core file."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.abort()


def abort_before_results(rank: int, world_size: int, port: int, out: str) -> None:
    """A rank that dies (SIGABRT) after its setup, before writing: ``run_world`` must fail
    with its log."""
    mark_ready(rank)
    print("rank about to abort", flush=True)
    _abort()


def abort_in_setup_once(rank: int, world_size: int, port: int, out: str, flag: str) -> None:
    """A rank that dies before it is ready the first time (``flag`` not yet there), and
    writes its results the second: ``run_world`` starts the world again and returns them."""
    if not Path(flag).exists():
        Path(flag).touch()
        _abort()
    mark_ready(rank)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"attempt": 2}))


def abort_after_results(rank: int, world_size: int, port: int, out: str) -> None:
    """A rank that writes its results, then dies: ``run_world`` warns and returns them."""
    mark_ready(rank)
    path = Path(out) / f"rank{rank}.json"
    path.write_text(json.dumps({"rank": rank}))
    _abort()


class _SetupFailed(RuntimeError):
    """The world failed before every rank had its group."""


def run_world(
    world_size: int, target: Callable[..., None], *args: Any, timeout: float = WORLD_TIMEOUT_S
) -> list[Any]:
    """Run ``target`` on ``world_size`` spawned ranks; return each rank's JSON result."""
    try:
        return _run_world(world_size, target, args, timeout)
    except _SetupFailed as e:
        warnings.warn(
            f"a world of {world_size} ranks failed in torch.distributed's setup, before any "
            f"rank was ready; started again: {e}",
            stacklevel=2,
        )
    try:
        return _run_world(world_size, target, args, timeout)
    except _SetupFailed as e:
        raise RuntimeError(f"twice in torch.distributed's setup: {e}") from None


def _run_world(
    world_size: int, target: Callable[..., None], args: tuple[Any, ...], timeout: float
) -> list[Any]:
    out = tempfile.mkdtemp(prefix="qkv-dist-")
    env = {
        "MPLCONFIGDIR": tempfile.mkdtemp(prefix="qkv-mpl-"),
        "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="qkv-inductor-"),
        "OMP_NUM_THREADS": "1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        ctx = mp.start_processes(
            _rank_main,
            args=(target, world_size, free_port(), out, *args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"a world of {world_size} ranks ran past {timeout:.0f} s; killed\n"
                        + _logs(out, world_size)
                    )
        except ProcessException as e:  # a rank raised or died: with what each rank printed
            ready = all((Path(out) / f"ready{r}").exists() for r in range(world_size))
            if not ready:
                raise _SetupFailed(f"{e}\n{_logs(out, world_size)}") from None
            written = all((Path(out) / f"rank{r}.json").exists() for r in range(world_size))
            if not written:
                raise RuntimeError(f"{e}\n{_logs(out, world_size)}") from None
            warnings.warn(
                f"every rank wrote its results, then: {e}\n{_logs(out, world_size)}",
                stacklevel=2,
            )
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join(10)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    results = []
    for r in range(world_size):
        path = Path(out) / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results
