"""Run a function on N real ranks (gloo on CPU), each test with a hard wall-clock bound.

Processes come from a forkserver that has torch, torch.distributed, FSDP and dynamo imported
already (DDP's constructor alone imports ~800 modules): a 4-rank run then starts in well under a
second instead of paying a torch import per rank. A rank that does not finish in time is killed
and the test fails with what every rank said: a hang fails, it never blocks the suite.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload([
    "torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel", "torch.distributed.fsdp", "nanhunt",
    "tests.zoo",
])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(fn: Callable[..., dict[str, Any]], rank: int, world: int, port: int, out: str, args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    result: dict[str, Any]
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
    except BaseException as e:  # reported to the test, with the rank's traceback
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def run(fn: Callable[..., dict[str, Any]], world: int, out: str, *args: Any, limit: float = 60.0,
        wait_for: tuple[int, ...] | None = None) -> list[dict[str, Any] | None]:
    """``fn(rank, world, *args)`` on ``world`` ranks; its returned dicts, by rank (None: no result).

    ``wait_for``: the ranks that must finish (default: all); the others are killed once these have.
    """
    port = free_port()
    procs = [_CTX.Process(target=_entry, args=(fn, r, world, port, out, args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    must = range(world) if wait_for is None else wait_for
    deadline = time.monotonic() + limit
    for r in must:
        procs[r].join(max(0.0, deadline - time.monotonic()))
    hung = [r for r in must if procs[r].is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    results: list[dict[str, Any] | None] = []
    for r in range(world):
        path = os.path.join(out, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as fh:
                results.append(json.load(fh))
        else:
            results.append(None)
    if hung:
        raise AssertionError(f"ranks {hung} still running after {limit:g} s (a hang); results: {results}")
    for r in must:
        res = results[r]
        if res is not None and "error" in res:
            raise AssertionError(f"rank {r} failed: {res['traceback']}")
    return results
