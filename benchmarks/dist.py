"""The cost of nanhunt's per-step agreement under torch.distributed (gloo, CPU).

For 2 and 4 ranks: a DDP training step with and without `nanhunt.watch` (interleaved rounds, median
step time), and the agreement alone: one all_reduce of three int32 on nanhunt's own gloo group.

    python benchmarks/dist.py                  # 2 and 4 ranks, ~1 min on 2 quiet cores
    python benchmarks/dist.py --ranks 2 --steps 20 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 1))


def _steps(ddp: nn.Module, opt: torch.optim.Optimizer, n: int) -> list[float]:
    times = []
    for _ in range(n):
        x = torch.randn(32, 64)
        t = time.perf_counter()
        ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    return times


def _worker(rank: int, world: int, port: int, steps: int, rounds: int, out: str) -> None:
    import nanhunt
    from nanhunt._record.dist import Group

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ddp = nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-4)
    plain: list[float] = []
    local: list[float] = []
    watched: list[float] = []
    _steps(ddp, opt, 3)  # warm up
    for i in range(rounds):
        for variant in (["plain", "local", "agreed"] * 2)[i % 3:i % 3 + 3]:  # the order rotates each round
            if variant == "plain":
                plain += _steps(ddp, opt, steps)
                continue
            with nanhunt.watch(ddp, optimizer=opt, distributed=variant == "agreed"):  # local: no agreement
                _steps(ddp, opt, 1)  # warm up (names, hooks)
                (local if variant == "local" else watched).extend(_steps(ddp, opt, steps))
    g = Group(60)
    g.all_max([0, 0, 0])  # connect
    agree = []
    for _ in range(200):
        t = time.perf_counter()
        g.all_max([0, 0, 0])
        agree.append(time.perf_counter() - t)
    g.close()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"plain": statistics.median(plain), "watched": statistics.median(watched),
                       "local": statistics.median(local),
                       "agree": statistics.median(agree)}, fh)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    print("ranks | plain ms/step | nanhunt, no agreement | nanhunt (agreed) | agreement alone (all_reduce, 12 bytes)")
    print("------+---------------+-----------------------+------------------+---------------------------------------")
    for world in a.ranks:
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "r.json")
            mp.start_processes(_worker, args=(world, _port(), a.steps, a.rounds, out), nprocs=world,
                               start_method="spawn")
            with open(out) as fh:
                r = json.load(fh)
        p = r["plain"]
        print(f"{world:5d} | {p * 1e3:13.2f} | {r['local'] * 1e3:8.2f} (x{r['local'] / p:.3f}) "
              f"| {r['watched'] * 1e3:7.2f} (x{r['watched'] / p:.3f}) | {r['agree'] * 1e6:.0f} µs")


if __name__ == "__main__":
    main()
