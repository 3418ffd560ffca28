"""torch.distributed: every rank stops at the same step and sees every rank's findings."""

from __future__ import annotations

import json
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import nanhunt


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1))
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-2)
        result: dict = {"rank": rank, "raised_at": None}
        try:
            with nanhunt.watch(ddp, optimizer=opt) as hunt:
                for step in range(5):
                    x = torch.randn(4, 8)
                    if rank == 1 and step == 2:
                        x[1, 3] = float("nan")  # bad data on one rank only
                    loss = ddp(x).pow(2).mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
        except nanhunt.NonFiniteError as e:
            result["raised_at"] = hunt.step
            result["first"] = e.finding.to_dict()
            result["findings"] = [f.to_dict() for f in e.report.findings]
        result["steps_done"] = hunt.step
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump(result, fh)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or sys.platform == "win32", reason="needs torch.distributed")
def test_all_ranks_raise_at_the_same_step_with_every_ranks_findings(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0["raised_at"] == r1["raised_at"] == 2  # both stop at step 2, before applying it
    for r in (r0, r1):
        ranks = {f["rank"] for f in r["findings"]}
        assert 1 in ranks, r["findings"]
        fwd = [f for f in r["findings"] if f["rank"] == 1 and f["phase"] == "forward"]
        assert fwd and fwd[0]["module"] == "module.0" and fwd[0]["cause"] == "input"
    assert r1["first"]["rank"] == 1
