"""on_find="skip" under torch.distributed: every rank skips the same steps, and the replicas stay equal."""

from __future__ import annotations

import json
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import nanhunt
from tests import zoo


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, case: str = "train") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = zoo.bnmlp()
        # no buffer broadcast in forward: a collective that the analysis's replays would issue unevenly
        ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(rank)
        with nanhunt.watch(ddp, optimizer=opt, on_find="skip") as hunt:
            for step in range(5):
                x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
                if case == "eval" and rank == 0 and step == 2:  # a validation batch with a NaN on rank 0 alone
                    ddp.eval()
                    with torch.no_grad():
                        v = torch.randn(8, 6, generator=g)
                        v[1, 1] = float("nan")
                        model(v)  # (the module itself, as a validation loop calls it: no DDP collective)
                    ddp.train()
                if case == "train" and rank == 1 and step == 2:
                    x[4, 0] = float("nan")  # a corrupt record on one rank only
                F.cross_entropy(ddp(x), y).backward()
                opt.step()
                opt.zero_grad()
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump({"skipped": hunt.skipped, "steps": hunt.step, "params": flat.tolist(),
                       "finite": bool(torch.isfinite(flat).all()),
                       "ranks": sorted({f.rank for f in hunt.findings if f.rank is not None})}, fh)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or sys.platform == "win32", reason="needs torch.distributed")
def test_every_rank_skips_the_same_steps(tmp_path: object) -> None:
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0 = json.loads((tmp_path / "rank0.json").read_text())  # type: ignore[operator]
    r1 = json.loads((tmp_path / "rank1.json").read_text())  # type: ignore[operator]
    assert r0["skipped"] == r1["skipped"] == [2]
    assert r0["steps"] == r1["steps"] == 5
    assert r0["finite"] and r0["params"] == r1["params"]  # the replicas never diverged
    assert 1 in r0["ranks"]  # rank 0 was told of rank 1's finding


@pytest.mark.skipif(not dist.is_available() or sys.platform == "win32", reason="needs torch.distributed")
def test_a_finding_in_a_validation_pass_drops_no_training_step_under_ddp(tmp_path: object) -> None:
    """Under torch.distributed an evaluation pass waits in the log for the next step's agreement
    (a sync of its own would be a collective one rank alone makes), so the pass's NaN was judged
    with the next training step's calls and every rank skipped that clean step. Each rank now says
    whether its findings are all in evaluation passes; no rank skips, the finding is kept."""
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path), "eval"), nprocs=2, join=True)
    r0 = json.loads((tmp_path / "rank0.json").read_text())  # type: ignore[operator]
    r1 = json.loads((tmp_path / "rank1.json").read_text())  # type: ignore[operator]
    assert r0["skipped"] == r1["skipped"] == []
    assert r0["finite"] and r0["params"] == r1["params"]
    assert r0["ranks"] == r1["ranks"] == [0]  # the finding is kept, on every rank
