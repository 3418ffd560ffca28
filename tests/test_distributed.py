"""torch.distributed on real process groups (gloo, CPU): DDP, FSDP2, torchrun, dead and silent ranks,
uneven shards, reductions that overflow. Each scenario runs its ranks with a hard time limit
(tests/ranks.py): a hang fails the test instead of blocking the suite."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import nanhunt

from . import ranks, zoo

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or sys.platform == "win32", reason="needs torch.distributed"),
]


def _raised(e: nanhunt.NonFiniteError, hunt: Any) -> dict[str, Any]:
    return {"raised_at": hunt.step, "first": e.finding.to_dict(), "findings": [f.to_dict() for f in e.report.findings]}


# ---------------------------------------------------------------------------- DDP, 4 ranks
def _ddp_nan_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    model = zoo.mlp(0, d_in=8, d_hidden=16)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)
    out: dict[str, Any] = {"raised_at": None}
    with pytest.raises(nanhunt.NonFiniteError) as info, nanhunt.watch(ddp, optimizer=opt, dist_timeout=30) as hunt:
        for step in range(5):
            x = torch.randn(4, 8)
            if rank == 2 and step == 3:
                x[1, 5] = float("nan")  # one bad sample on one rank
            ddp(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    out.update(_raised(info.value, hunt))
    out["weights_finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return out


def test_ddp_four_ranks_every_rank_names_the_rank_with_the_bad_sample(tmp_path):
    res = ranks.run(_ddp_nan_on_one_rank, 4, str(tmp_path), limit=60)
    for r in res:
        assert r is not None and r["raised_at"] == 3, r
        first = r["first"]
        assert (first["rank"], first["phase"], first["module"], first["cause"]) == (2, "forward", "0", "input"), first
        assert first["step"] == 3
        # rank 0, 1, 3 received the NaN only through the all-reduce: no finding of theirs
        assert {f["rank"] for f in r["findings"]} == {2}, r["findings"]
        assert r["weights_finite"]  # raised before the optimizer applied the poisoned step
    assert len({json.dumps(r["findings"], sort_keys=True) for r in res}) == 1  # the same report everywhere


def _bundle_on_every_rank(rank: int, world: int, path: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(zoo.Log(), nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as said, pytest.raises(nanhunt.NonFiniteError) as info:
        warnings.simplefilter("always")
        with nanhunt.watch(ddp, optimizer=opt, bundle=path, dist_timeout=30):
            for step in range(3):
                x = torch.rand(4, 4) + 1.0
                if rank == 1 and step == 1:
                    x[2, 1] = 0.0  # log(0) on rank 1 only
                ddp(x).sum().backward()
                opt.step()
                opt.zero_grad()
    return {"first": [info.value.finding.rank, info.value.finding.phase], "said": [str(w.message) for w in said]}


def test_a_rank_that_only_received_the_bad_gradient_does_not_warn_that_no_bundle_was_written(tmp_path):
    """log(0) in rank 1's forward; rank 0 got the NaN only through DDP's all-reduce. Rank 0 warned
    "wrote no repro bundle: the first finding (grad of 1) is not a watched module's forward call"
    (its received gradient, which is no finding of its own; the first finding, rank 1's forward,
    has its bundle on rank 1). Only the rank whose own first finding cannot be bundled warns."""
    res = ranks.run(_bundle_on_every_rank, 2, str(tmp_path), str(tmp_path / "first.pt"), limit=60)
    for r in res:
        assert r is not None and r["first"] == [1, "forward"], r
        assert not [w for w in r["said"] if "repro bundle" in w], r["said"]
    assert (tmp_path / "first.rank1.pt").is_file() and not (tmp_path / "first.pt").exists()


# ---------------------------------------------------------------------------- FSDP2, 2 ranks
def _fsdp2(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    model = zoo.mlp(0, d_in=8, d_hidden=16)
    fully_shard(model[0])
    fully_shard(model[3])
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)
    out: dict[str, Any] = {}
    with pytest.raises(nanhunt.NonFiniteError) as info, nanhunt.watch(model, optimizer=opt, dist_timeout=30) as hunt:
        for step in range(4):
            x = torch.randn(4, 8)
            if rank == 1 and step == 2:
                x[3, 1] = float("inf")
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    out.update(_raised(info.value, hunt))
    out["names"] = sorted(n for n, _ in model.named_parameters())
    out["sharded"] = type(model[0].weight).__name__
    # close() put FSDP2's own reduce-scatter back
    out["comms"] = sorted({type(g._reduce_scatter_comm).__name__ for m in model.modules()
                           if hasattr(m, "_get_fsdp_state") for g in m._get_fsdp_state()._fsdp_param_groups})
    return out


def test_fsdp2_two_ranks_names_module_and_rank_without_gathering(tmp_path):
    res = ranks.run(_fsdp2, 2, str(tmp_path), limit=60)
    for r in res:
        assert r is not None
        assert r["names"] == ["0.bias", "0.weight", "3.bias", "3.weight"] and r["sharded"] == "DTensor"
        assert r["comms"] == ["DefaultReduceScatter"]
        assert r["raised_at"] == 2
        first = r["first"]
        assert (first["rank"], first["phase"], first["module"], first["module_type"]) == (1, "forward", "0", "Linear")
        # no replay under FSDP2 (it would all-gather on one rank alone): module-level, cause unknown
        assert first["reproducible"] is None and first["cause"] == "unknown" and first["step"] == 2
        # (its hint was empty: it says what is not known under FSDP2, and how to have the op)
        assert "FSDP2" in first["hint"] and "mode='ops'" in first["hint"], first["hint"]
        assert {f["rank"] for f in r["findings"]} == {1}, r["findings"]
        # the culprit's gradient, judged on its own shard (rows 8-15 of 16), indexed in the whole tensor
        grad = next(f for f in r["findings"] if f["phase"] == "grad")
        assert (grad["module"], grad["tensor"], grad["index"], grad["shape"]) == ("0", "weight.grad", [8, 1], [16, 8])
    assert res[0]["findings"] == res[1]["findings"]


def _fsdp2_backward(rank: int, world: int, grad_hooks: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    model = zoo.distnet(0)
    fully_shard(model.proj)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)
    with pytest.raises(nanhunt.NonFiniteError) as info, nanhunt.watch(model, optimizer=opt, grad_hooks=grad_hooks,
                                                                      dist_timeout=30) as hunt:
        for step in range(3):
            x = torch.randn(4, 4)
            if rank == 1 and step == 2:
                x[1, 2:] = x[1, :2]  # equal halves on rank 1 only: sqrt at 0 in `dist`'s backward
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return _raised(info.value, hunt)


@pytest.mark.parametrize("grad_hooks", [False, True])
def test_fsdp2_a_nan_born_in_one_ranks_backward_is_not_blamed_on_a_weight_gradient(tmp_path, grad_hooks):
    """Under FSDP2 nothing is replayed, so no module's gradient is judged without grad_hooks: the NaN
    made by `dist`'s backward on rank 1 was `proj`'s weight gradient "born here", its hint saying
    every module's gradients were finite. Its origin is unknown and the hint says to pass
    grad_hooks=True, which names `dist`'s backward on rank 1."""
    res = ranks.run(_fsdp2_backward, 2, str(tmp_path), grad_hooks, limit=60)
    for r in res:
        assert r is not None and r["raised_at"] == 2, r
        first = r["first"]
        assert (first["rank"], first["step"]) == (1, 2), first
        if grad_hooks:
            assert (first["phase"], first["module"], first["cause"]) == ("backward", "dist", "created"), first
        else:
            assert (first["phase"], first["module"], first["tensor"], first["cause"]) == (
                "grad", "proj", "weight.grad", "unknown"), first
            assert "FSDP2" in first["hint"] and "grad_hooks=True" in first["hint"], first["hint"]
            assert "were finite" not in first["hint"], first["hint"]
    assert res[0]["findings"] == res[1]["findings"]


# ---------------------------------------------------------------------------- float16 reduction overflow
def _sum_then_average(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations
    """A user's DDP comm hook that sums first and divides after (as many hand-rolled ones do)."""
    n = dist.get_world_size()
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(n))


def _fp16_overflow_case(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1).half()
    ddp = nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, _sum_then_average)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    out: dict[str, Any] = {"local_grad": None}
    with pytest.raises(nanhunt.NonFiniteError) as info, nanhunt.watch(ddp, optimizer=opt, dist_timeout=30) as hunt:
        for step in range(3):
            value = 1.0 if step < 2 else 300.0  # each rank's weight gradient: 128 * 300 = 38400 (finite)
            x = torch.full((128, 4), value, dtype=torch.float16)
            ddp(x).sum().backward()  # summed over the ranks before dividing: 76800 > 65504 = inf
            opt.step()
            opt.zero_grad()
    out.update(_raised(info.value, hunt))
    return out


def test_float16_gradients_that_overflow_only_when_summed_are_a_reduced_grad_finding(tmp_path):
    res = ranks.run(_fp16_overflow_case, 2, str(tmp_path), limit=60)
    for r in res:
        assert r is not None and r["raised_at"] == 2
        first = r["first"]
        assert first["phase"] == "grad" and first["tensor"] == "weight.grad (reduced)", first
        assert first["value"] == "inf" and first["dtype"] == "float16" and first["cause"] == "created"
        assert first["rank"] == 0  # the same reduced gradient on every rank: reported once
        assert [f["tensor"] for f in r["findings"] if f["phase"] == "grad"] == ["weight.grad (reduced)"]
    assert res[0]["findings"] == res[1]["findings"]


# ---------------------------------------------------------------------------- a clean run is untouched
def _train(watched: bool, rank: int) -> list[torch.Tensor]:
    model = zoo.mlp(0, d_in=8, d_hidden=16)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    hunt = nanhunt.watch(ddp, optimizer=opt, dist_timeout=30) if watched else None
    torch.manual_seed(100 + rank)
    for _ in range(6):
        ddp(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    if hunt is not None:
        hunt.close()
        assert not any(p._post_accumulate_grad_hooks for p in model.parameters())  # nothing left behind
    return [p.detach().clone() for p in model.parameters()]


def _bit_identical(rank: int, world: int) -> dict[str, Any]:
    plain = _train(False, rank)
    watched = _train(True, rank)
    again = _train(False, rank)
    return {"same": all(zoo.bit_equal(a, b) for a, b in zip(plain, watched)),
            "control": all(zoo.bit_equal(a, b) for a, b in zip(plain, again))}


def test_a_clean_ddp_run_is_bit_identical_with_and_without_nanhunt(tmp_path):
    res = ranks.run(_bit_identical, 2, str(tmp_path), limit=60)
    for r in res:
        assert r == {"same": True, "control": True}


# ---------------------------------------------------------------------------- uneven inference shards
def _uneven(rank: int, world: int) -> dict[str, Any]:
    model = zoo.mlp(0).eval()
    batches = 3 if rank == 0 else 2  # uneven shards, no optimizer
    with nanhunt.watch(model, on_find="record", dist_timeout=30) as hunt, torch.no_grad():
        for b in range(batches):
            x = torch.randn(5, 4)
            if rank == 1 and b == 1:
                x[2, 0] = float("inf")
            model(x)
        total = torch.tensor([float(batches)])
        dist.all_reduce(total)  # the user's own collective: must pair with the other rank's
        dist.barrier()
    return {"total": total.item(), "findings": [(f.rank, f.phase, f.step) for f in hunt.findings]}


def test_uneven_inference_shards_add_no_collective_and_the_users_own_still_pairs(tmp_path):
    res = ranks.run(_uneven, 2, str(tmp_path), limit=60)
    assert res[0] == {"total": 5.0, "findings": []}
    assert res[1] == {"total": 5.0, "findings": [[1, "forward", 1]]}


def _one_report_path(rank: int, world: int, path: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(zoo.Log(), nn.Linear(4, 1)).eval()
    bundle = path.replace(".json", ".pt")
    with nanhunt.watch(model, on_find="record", report=path, bundle=bundle, dist_timeout=30) as hunt, torch.no_grad():
        for b in range(2 + rank):  # uneven shards, no optimizer: nothing is merged
            x = torch.rand(5, 4) + 1.0
            if rank == 1 and b == 1:
                x[2, 1] = 0.0  # log(0) on rank 1 only
            model(x)
        if rank == 0:
            time.sleep(1.0)  # (rank 0, clean, closes last)
    return {"findings": [(f.rank, f.phase, f.module) for f in hunt.findings]}


def test_ranks_given_one_report_path_write_one_file_each_rank_0s_at_that_path(tmp_path):
    """Every rank of one script passes the same report=: each wrote that file, the last to close
    winning. Rank 0, clean, closed last and its "no NaN/Inf found" replaced rank 1's finding
    (no optimizer: nothing merged). Ranks other than 0 now write `r.rank<N>.json` beside it; and
    `bundle=` the same way (two ranks' first findings raced for one bundle, which then held another
    rank's call than the report's first finding)."""
    path = str(tmp_path / "r.json")
    res = ranks.run(_one_report_path, 2, str(tmp_path), path, limit=60)
    assert res[0] == {"findings": []} and res[1] == {"findings": [[1, "forward", "0"]]}, res
    with open(path) as fh:
        mine = json.load(fh)
    with open(tmp_path / "r.rank1.json") as fh:
        theirs = json.load(fh)
    assert mine["meta"]["rank"] == 0 and mine["findings"] == []
    assert theirs["meta"]["rank"] == 1
    assert [(f["rank"], f["module"], f["op"]) for f in theirs["findings"]] == [(1, "0", "aten.log.default")]
    # (bundle= too: rank N's first finding in its own file, never another rank's under the path given)
    assert not (tmp_path / "r.pt").exists()
    again = nanhunt.replay(str(tmp_path / "r.rank1.pt"), module=zoo.Log)
    assert again.reproduced and again.expected is not None and again.expected.rank == 1


# ---------------------------------------------------------------------------- collectives inside the forward
class _RowParallel(nn.Module):
    """A tensor-parallel linear layer: each rank holds a slice of the weight, the outputs are summed."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        dist.all_reduce(y)
        return y


def _tensor_parallel(rank: int, world: int, on_find: str) -> dict[str, Any]:
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), _RowParallel())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    raised = []
    with nanhunt.watch(model, optimizer=opt, on_find=on_find, dist_timeout=10) as hunt:
        for step in range(4):
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            if rank == 1 and step == 2:
                x[0, 0] = float("nan")
            try:
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            except nanhunt.NonFiniteError:
                raised.append(step)
            opt.zero_grad()
    return {"raised": raised, "skipped": hunt.skipped, "findings": [(f.rank, f.step, f.module) for f in hunt.findings],
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}


@pytest.mark.parametrize("on_find", ["raise", "skip"])
def test_a_forward_with_its_own_collective_is_analysed_without_a_collective_on_one_rank(tmp_path, on_find):
    """A layer that all-reduces in its forward (tensor parallelism; SyncBatchNorm on GPUs): the
    analysis replayed the failing call on each rank alone, and the replay's all_reduce waited for
    ranks that were not replaying (or paired with another rank's replay): every rank raised
    SilentRankError after dist_timeout, naming a healthy rank as dead, and the finding was lost.
    A collective in a replay now fails at once; every rank reports and skips the same step."""
    res = ranks.run(_tensor_parallel, 2, str(tmp_path), on_find, limit=60)
    for r in res:
        assert r is not None and r["finite"], r
        assert r["raised"] == ([2] if on_find == "raise" else []) and r["skipped"] == ([2] if on_find == "skip" else [])
        assert (1, 2, "0") in [tuple(f) for f in r["findings"]], r  # rank 1's bad sample, at its first module
    assert res[0]["findings"] == res[1]["findings"]


class _RowNorm(nn.Module):
    """Rows scaled to unit length: an all-zero row (padding) is 0/0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True)


class _RowParallelAutograd(_RowParallel):
    """The same, through the autograd-aware functional all_reduce (a new tensor, not in place)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dist.nn.functional.all_reduce(self.lin(x))


def _spread_by_all_reduce(rank: int, world: int, mode: str, layer: str) -> dict[str, Any]:
    import torch.distributed.nn  # noqa: F401  (dist.nn.functional)

    torch.manual_seed(rank)
    model = nn.Sequential(_RowNorm(), nn.Linear(6, 8), nn.Tanh(), _RowParallel() if layer == "inplace" else _RowParallelAutograd())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(nanhunt.NonFiniteError) as info, nanhunt.watch(model, optimizer=opt, mode=mode, dist_timeout=10):
        for step in range(3):
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            if rank == 1 and step == 2:
                x[3] = 0.0  # an empty row on rank 1 only; the all_reduce hands its NaN to rank 0
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return {"first": info.value.finding.to_dict(),
            "mine": [f.to_dict() for f in info.value.report.findings if f.rank == rank and f.phase == "forward"]}


@pytest.mark.parametrize(("mode", "layer"), [("full", "inplace"), ("sentinel", "inplace"), ("full", "functional")])
def test_a_nan_one_rank_made_that_a_forward_all_reduce_spread_is_named_on_that_rank(tmp_path, mode, layer):
    """A tensor-parallel all_reduce in the forward hands rank 1's NaN to rank 0, writing the output
    in place (no version counter moves). The replay stops at the collective (`_NoCollectives`), and
    was then dropped whole: rank 1's finding had cause "unknown" and no op, rank 0's (the healthy
    rank, a Linear whose output the all_reduce overwrote) came first, and its hint blamed hardware.
    The calls that returned before the collective are used; rank 0's is told as received. (The
    functional all_reduce: the call it ran in, left by the refusal, was taken as returned, with no
    output: rank 0's finding came out "not reproducible", its hint blaming hardware.)"""
    res = ranks.run(_spread_by_all_reduce, 2, str(tmp_path), mode, layer, limit=60)
    for r in res:
        assert r is not None
        first = r["first"]
        assert (first["rank"], first["step"], first["phase"], first["module"], first["cause"], first["op"]) == (
            1, 2, "forward", "0", "created", "aten.div.Tensor"), first
        assert first["source"].endswith(f"test_distributed.py:{_RowNorm.forward.__code__.co_firstlineno + 1}")
    if mode == "full":
        received = res[0]["mine"][0]
        assert received["reproducible"] is None and received["verdict"] is None, received
        if layer == "inplace":
            assert (received["module"], received["cause"]) == ("3.lin", "input")
            assert "born on another rank" in received["hint"], received["hint"]
        else:
            assert (received["module"], received["cause"]) == ("3", "unknown")
            assert "may have come from another rank" in received["hint"], received["hint"]


# ---------------------------------------------------------------------------- dead and silent ranks
def _silent_ranks(rank: int, world: int) -> dict[str, Any]:
    model = zoo.mlp(rank)  # each rank trains its own model: the only collective is nanhunt's
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    t0 = time.monotonic()
    try:
        with nanhunt.watch(model, optimizer=opt, dist_timeout=4) as hunt:
            for step in range(4):
                model(torch.randn(3, 4)).sum().backward()
                if step == 2 and rank == 1:
                    os._exit(0)  # dies mid-step
                if step == 2 and rank == 2:
                    time.sleep(30)  # stops answering
                opt.step()
                opt.zero_grad()
    except nanhunt.SilentRankError as e:
        return {"ranks": list(e.ranks), "after": time.monotonic() - t0, "message": str(e), "step": hunt.step}
    return {"ranks": None}


def test_a_rank_that_dies_and_one_that_hangs_are_named_within_dist_timeout(tmp_path):
    res = ranks.run(_silent_ranks, 4, str(tmp_path), limit=40, wait_for=(0, 3))
    for r in (res[0], res[3]):
        assert r is not None and r["ranks"] == [1, 2], r
        assert r["step"] == 2
        assert r["after"] < 4 + 2.0, r  # within dist_timeout (plus the model's own steps)
        assert "ranks 1, 2 did not answer within dist_timeout=4 s" in r["message"]


def _fewer_steps(rank: int, world: int, how: str) -> dict[str, Any]:
    model = zoo.mlp(rank)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    t0 = time.monotonic()
    try:
        with nanhunt.watch(model, optimizer=opt, dist_timeout=4) as hunt:
            for step in range(3 + rank):  # rank 1 has one batch more
                if how == "error" and rank == 0 and step == 2:
                    raise KeyError("the loader's own error")
                model(torch.randn(3, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
    except nanhunt.SilentRankError as e:
        return {"ranks": list(e.ranks), "after": time.monotonic() - t0, "message": str(e), "step": hunt.step}
    except KeyError:
        pass
    time.sleep(4)  # (alive, its hunt closed)
    return {"ranks": None}


@pytest.mark.parametrize("how", ["fewer", "error"])
def test_a_rank_whose_hunt_ended_is_named_as_closed_not_as_dead(tmp_path, how):
    """Rank 0 ran 3 optimizer steps (or left its loop by an error at the 3rd) and closed its hunt;
    rank 1 went on. Rank 1 raised SilentRankError after dist_timeout saying rank 0 "died or stopped
    answering" (it was alive and well): the hunt's close now tells the others, who say so at once,
    and what to do."""
    res = ranks.run(_fewer_steps, 2, str(tmp_path), how, limit=40)
    assert res[0] == {"ranks": None}
    n = 3 if how == "fewer" else 2
    assert res[1] is not None and res[1]["ranks"] == [0] and res[1]["step"] == n, res[1]
    said = {"fewer": "rank 0 closed its hunt after 3 optimizer steps while this rank, after 3, went on",
            "error": "rank 0 left its hunt by an error after 2 optimizer steps while this rank, after 2, went on"}
    assert said[how] in res[1]["message"], res[1]["message"]
    assert "died" not in res[1]["message"]
    assert ("distributed=False" in res[1]["message"]) == (how == "fewer"), res[1]["message"]
    assert res[1]["after"] < 4, res[1]  # not a wait for dist_timeout


def _watched_on_rank_0_only(rank: int, world: int) -> dict[str, Any]:
    model = zoo.mlp(rank)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    if rank == 1:  # (debugging one rank: this one runs without nanhunt)
        time.sleep(6)
        return {}
    try:
        with nanhunt.watch(model, optimizer=opt, dist_timeout=3):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
    except nanhunt.SilentRankError as e:
        return {"ranks": list(e.ranks), "message": str(e)}
    return {"ranks": None}


def test_a_rank_that_never_opened_a_hunt_is_named_and_the_remedy_said(tmp_path):
    """watch() on rank 0 only (debugging one rank): rank 0 waited dist_timeout at its first step and
    raised SilentRankError naming rank 1 as "died or stopped answering" (a healthy rank). It still
    names it, and says to open the hunt on every rank or pass distributed=False."""
    res = ranks.run(_watched_on_rank_0_only, 2, str(tmp_path), limit=40)
    assert res[0]["ranks"] == [1], res[0]
    assert "open the hunt on every rank, or pass distributed=False" in res[0]["message"], res[0]["message"]


def _own_finding_when_the_other_rank_falls_silent(rank: int, world: int, when: str) -> dict[str, Any]:
    model = zoo.lognet(0)  # (ReLU zeros: log(0) = -inf on both ranks)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    if rank == 1 and when == "gather":
        own, calls = model.log.forward, [0]

        def dies_in_its_replay(x: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            if calls[0] == 2:
                os._exit(1)
            return own(x)
        model.log.forward = dies_in_its_replay
    try:
        with nanhunt.watch(model, optimizer=opt, dist_timeout=3) as hunt:
            loss = model(torch.randn(8, 4)).sum()
            if rank == 1 and when == "agree":
                raise ValueError("the loop's own check of the loss")
            loss.backward()
            opt.step()
    except nanhunt.SilentRankError as e:
        return {"ranks": list(e.ranks), "notes": getattr(e, "__notes__", []),
                "findings": [f.to_dict() for f in hunt.findings]}
    except ValueError:
        time.sleep(1)
    return {"ranks": None}


@pytest.mark.parametrize("when", ["agree", "gather"])
def test_a_ranks_own_finding_is_kept_when_another_rank_falls_silent(tmp_path, when):
    """Both ranks made -inf; rank 1 left (its loop raised on the loss before step()) or died in its
    analysis of the step. Rank 0 raised SilentRankError with nothing recorded: its own finding was
    lost (report "no NaN/Inf found"). It is now judged on this rank alone, kept, and noted."""
    res = ranks.run(_own_finding_when_the_other_rank_falls_silent, 2, str(tmp_path), when, limit=40, wait_for=(0,))
    assert res[0] is not None and res[0]["ranks"] == [1], res[0]
    first = res[0]["findings"][0]
    assert (first["rank"], first["module"], first["op"], first["value"]) == (0, "log", "aten.log.default", "-inf"), first
    assert any("this rank's own first finding" in n for n in res[0]["notes"]), res[0]["notes"]


def _slower_than_the_wait(rank: int, world: int) -> dict[str, Any]:
    model = zoo.mlp(rank)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    try:
        with nanhunt.watch(model, optimizer=opt, dist_timeout=2) as hunt:  # (the collective waits 1.5 s)
            for step in range(2):
                if rank == 1 and step == 1:
                    time.sleep(1.75)
                model(torch.randn(3, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
    except nanhunt.SilentRankError as e:
        return {"ranks": list(e.ranks), "message": str(e), "step": hunt.step}
    return {"ranks": None}


def test_a_rank_that_came_after_the_wait_is_told_as_slow_with_the_remedy(tmp_path):
    """Rank 1 came to step 1's agreement 1.75 s late (dist_timeout=2: the collective waits 1.5 s).
    Rank 0 raised "the agreement between ranks failed" naming nobody, and no remedy: it now says
    that every rank came, too late for the wait, and that such a rank needs a larger dist_timeout."""
    res = ranks.run(_slower_than_the_wait, 2, str(tmp_path), limit=40)
    assert res[0] is not None and res[0]["ranks"] == [] and res[0]["step"] == 1, res[0]
    assert "every rank came to nanhunt's agreement (agree), but not within the 1.5 s" in res[0]["message"], res[0]
    assert "needs a larger dist_timeout" in res[0]["message"], res[0]["message"]


def _one_step_more_under_ddp(rank: int, world: int) -> dict[str, Any]:
    ddp = nn.parallel.DistributedDataParallel(zoo.mlp(0))
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-2)
    try:
        with nanhunt.watch(ddp, optimizer=opt, dist_timeout=3) as hunt:
            for step in range(3):
                ddp(torch.randn(3, 4)).sum().backward()
                opt.step()
                if rank == 1 and step == 0:
                    opt.step()  # (one step() too many: rank 0 is in DDP's all-reduce of its next backward)
                opt.zero_grad()
    except nanhunt.SilentRankError as e:
        return {"ranks": list(e.ranks), "message": str(e), "step": hunt.step}
    return {"ranks": None}


def test_a_rank_waiting_in_ddps_all_reduce_is_named_as_running_not_as_dead(tmp_path):
    """Rank 1 called step() once more than rank 0: its agreement waited for rank 0, which waited in
    DDP's all-reduce for rank 1. After dist_timeout rank 1 said rank 0 "died or stopped answering"
    (it was alive and well): a collective that ran to its time limit broke no connection, so the
    rank is named as running elsewhere, and the likely cause said."""
    res = ranks.run(_one_step_more_under_ddp, 2, str(tmp_path), limit=40, wait_for=(1,))
    assert res[1] is not None and res[1]["ranks"] == [0] and res[1]["step"] == 1, res[1]
    assert "rank 0 did not answer within dist_timeout=3 s (agree): still running" in res[1]["message"], res[1]
    assert "optimizer.step() different numbers of times" in res[1]["message"], res[1]["message"]
    assert "died" not in res[1]["message"], res[1]["message"]


# ---------------------------------------------------------------------------- nanhunt run under torchrun
_SCRIPT = """
import os, torch, torch.distributed as dist
from torch import nn
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
ddp = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=1e-2)
torch.manual_seed(1 + rank)
for step in range(4):
    x = torch.randn(4, 8)
    if rank == 1 and step == 2:
        x[0, 0] = float("nan")
    ddp(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
print("never here", flush=True)
"""


def test_nanhunt_run_under_torchrun_one_merged_report_and_exit_3_on_every_rank(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    report = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--log-dir", str(tmp_path / "logs"), "--redirects", "3", "-m", "nanhunt", "run",
           "--report", str(report), "--dist-timeout", "30", str(script)]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert report.exists() and not (tmp_path / "r.rank1.json").exists()  # one report, from rank 0
    data = json.loads(report.read_text())
    assert data["first"]["rank"] == 1 and data["first"]["module"] == "0" and data["first"]["step"] == 2
    assert {f["rank"] for f in data["findings"]} == {1}
    for r in (0, 1):
        err = next((tmp_path / "logs").rglob(f"attempt_0/{r}/stderr.log")).read_text()
        assert "never here" not in err
        assert ("nanhunt: report written to" in err) == (r == 0)  # rank 0 prints the merged report
    codes = dict(re.findall(r"rank\s*:\s*(\d+) \(local_rank.*\n\s*exitcode\s*:\s*(-?\d+)", p.stderr + p.stdout))
    # every rank exits 3 — unless torchrun, which stops the other workers as soon as one exits
    # non-zero, SIGTERMs it first (after the report is written: the ranks wait for rank 0 to write)
    assert set(codes) == {"0", "1"} and "3" in codes.values(), p.stderr[-3000:]
    assert set(codes.values()) <= {"3", "-15"}, p.stderr[-3000:]


_OWN_ERROR = """
import torch
from torch import nn
rank = torch.distributed.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
for step in range(4):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    if rank == 1 and step == 2:
        raise RuntimeError("the loader broke")
    opt.step()
    opt.zero_grad()
"""


def _run_own_error(rank: int, world: int, script: str) -> dict[str, Any]:
    import contextlib
    import io

    from nanhunt._cli.main import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["run", "--dist-timeout", "10", script])
    return {"code": code, "stderr": err.getvalue()}


def test_nanhunt_run_a_rank_whose_script_raised_is_named_as_left_by_an_error(tmp_path):
    """Under `nanhunt run`, rank 1's script raised its own error mid-run: rank 0 was told "rank 1
    closed its hunt after 2 optimizer steps ... the ranks ran different numbers of optimizer steps
    (... pass distributed=False)", sending the user to uneven data instead of rank 1's traceback:
    the hunts were closed as if the script had ended. They now close as left by an error."""
    script = tmp_path / "train.py"
    script.write_text(_OWN_ERROR)
    res = ranks.run(_run_own_error, 2, str(tmp_path), str(script), limit=60)
    assert res[1] is not None and res[1]["code"] == 1 and "the loader broke" in res[1]["stderr"], res[1]
    assert res[0] is not None and res[0]["code"] == 1, res[0]
    said = res[0]["stderr"]
    assert "rank 1 left its hunt by an error after 2 optimizer steps" in said and "see that rank's own error" in said, said
    assert "different numbers of optimizer steps" not in said, said


def test_dist_timeout_is_validated():
    with pytest.raises(ValueError, match="dist_timeout"):
        nanhunt.watch(zoo.mlp(), dist_timeout=0)
    with pytest.raises(ValueError, match="dist_timeout"):
        nanhunt.watch(zoo.mlp(), dist_timeout="300")


def _f(rank: int, phase: str, tensor: str = "output", step: int = 3) -> dict[str, Any]:
    return nanhunt.Finding(phase=phase, module="0", module_type="Linear", tensor=tensor, step=step, call=0,
                           index=(0,), value=float("nan"), counts={"nan": 1, "+inf": 0, "-inf": 0}, shape=(2,),
                           dtype="float32", cause="created", rank=rank).to_dict()


def test_merge_puts_every_ranks_findings_in_one_order_and_keeps_a_reduced_gradient_once():
    from nanhunt._record.dist import merge

    everyone = [
        [_f(0, "grad", "weight.grad (reduced)")],
        [_f(1, "grad", "weight.grad (reduced)"), _f(1, "optimizer", "weight", step=2)],
        [_f(2, "grad", "weight.grad"), _f(2, "forward")],
    ]
    got = [(f.rank, f.phase, f.tensor) for f in merge(everyone)]
    assert got == [(1, "optimizer", "weight"), (2, "forward", "output"), (0, "grad", "weight.grad (reduced)"),
                   (2, "grad", "weight.grad")]


def test_merge_puts_the_rank_that_knows_the_cause_first():
    """FSDP2: a weight loaded NaN in rank 1's shard is all-gathered into every rank's forward. Rank 1
    says cause "parameter" (loaded that way: run nanhunt audit); rank 0 can only say "unknown" and
    was first, on every rank, for being rank 0. A rank's own findings keep their order."""
    from nanhunt._record.dist import merge

    def f(rank: int, cause: str, module: str = "0", phase: str = "forward") -> dict[str, Any]:
        return {**_f(rank, phase, step=0), "cause": cause, "module": module}

    got = [(g.rank, g.phase, g.module, g.cause) for g in merge([
        [f(0, "unknown"), f(0, "input", "3"), f(0, "input", "0", "grad")],
        [f(1, "parameter"), f(1, "input", "3"), f(1, "input", "0", "grad")],
    ])]
    assert got == [(1, "forward", "0", "parameter"), (1, "forward", "3", "input"), (0, "forward", "0", "unknown"),
                   (0, "forward", "3", "input"), (0, "grad", "0", "input"), (1, "grad", "0", "input")]


def test_judge_drops_gradients_received_through_the_reduction_and_names_an_overflow_in_it():
    from nanhunt._record.dist import judge

    mine = [nanhunt.Finding.from_dict(_f(0, "grad", "weight.grad"))]
    # [anyone bad, anyone's local gradients bad, anyone's unknown, this rank's local gradients bad]
    assert judge(mine, [1, 1, 0, 0]) == []  # another rank's gradient was bad first: not ours
    assert judge(mine, [1, 1, 0, 1]) == mine  # ours was bad before the reduction: ours
    assert judge(mine, [1, 1, 1, 0]) == mine  # some rank could not tell: left as found
    (reduced,) = judge(mine, [1, 0, 0, 0])  # finite everywhere before, non-finite after
    assert reduced.tensor == "weight.grad (reduced)" and "overflowed" in (reduced.hint or "")


# ---------------------------------------------------------------------------- Lightning's DDP strategy
_LIGHTNING_DDP = """
import json, os, sys, torch, lightning as L
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from nanhunt.integrations.lightning import NanHunt


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)  # log(0) where ReLU zeroed a row


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin, self.act, self.log_, self.head = nn.Linear(4, 4), nn.ReLU(), Log(), nn.Linear(4, 1)
        with torch.no_grad():
            self.lin.weight.fill_(0.1)
            self.lin.bias.fill_(1.0)

    def forward(self, x):
        return self.head(self.log_(self.act(self.lin(x))))

    def training_step(self, batch, i):
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


x = torch.rand(32, 4)
x[13] = -100.0  # lin's outputs there < 0: ReLU gives 0, log gives -inf
cb = NanHunt(dist_timeout=60)
trainer = L.Trainer(strategy="ddp", devices=2, accelerator="cpu", max_epochs=1, callbacks=[cb], logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
try:
    trainer.fit(Net(), DataLoader(TensorDataset(x), batch_size=4))
    out = None
except Exception as e:
    f = getattr(e, "finding", None)
    out = f.to_dict() if f is not None else repr(e)
with open(sys.argv[1] + "." + os.environ.get("LOCAL_RANK", "0"), "w") as fh:
    json.dump(out, fh)
"""


def test_lightning_ddp_strategy_finding_has_its_op_and_element_on_every_rank(tmp_path):
    # Lightning's strategies run training_step through the model's forward (a `wrapped_forward`
    # set for one call): the finding was "origin unknown" on every rank (no op, element, cause)
    script = tmp_path / "fit.py"
    script.write_text(textwrap.dedent(_LIGHTNING_DDP))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "found")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    for r in (0, 1):
        f = json.loads((tmp_path / f"found.{r}").read_text())
        assert isinstance(f, dict), f
        assert (f["phase"], f["module"], f["module_type"], f["cause"], f["op"]) == \
            ("forward", "log_", "Log", "created", "aten.log.default"), f
        assert f["value"] == "-inf" or f["value"] == float("-inf"), f
