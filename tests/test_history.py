"""The magnitude history and the early warnings, from real runs (not synthetic reports)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt


def test_history_is_bounded_and_has_every_stat():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nanhunt.watch(model, optimizer=opt, history=4, stats_every=1) as hunt:
        for _ in range(10):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    h = hunt.report.history
    assert h["steps"] == [6, 7, 8, 9]  # the last `history` steps, whatever the run length
    assert {"0", "1", "2"} <= set(h["modules"])
    i = h["modules"].index("1")
    assert all(isinstance(v, float) and v > 0 for v in h["absmax"][i])
    assert all(0.0 <= v <= 1.0 for v in h["zeros"][i])
    assert h["headroom"][i][-1] > 1e30  # float32: far from its max
    json.dumps(hunt.report.to_dict(), allow_nan=False)  # plain, JSON-ready data


def test_a_validation_loop_does_not_push_the_training_steps_out_of_the_history():
    """A validation loop (eval mode, no_grad) at a sampled step: each batch was its own sample of
    that step, and `history` of them left the report a row of copies of one step, no training
    step in it. Evaluation passes are no steps: the history keeps the training steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nanhunt.watch(model, optimizer=opt, history=4, stats_every=1) as hunt:
        for step in range(10):
            model.train()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if step in (5, 9):
                model.eval()
                with torch.no_grad():
                    for _ in range(6):
                        model(torch.randn(4, 8))
    assert hunt.findings == []
    assert hunt.report.history["steps"] == [6, 7, 8, 9]


def test_fp16_activation_near_its_max_is_an_early_warning_not_a_finding():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).half()
    with torch.no_grad():
        for lin, w in zip(model, (1.0, 250.0)):
            lin.weight.fill_(w)
            lin.bias.zero_()
    with nanhunt.watch(model, on_find="record", stats_every=1) as hunt:
        out = model(torch.full((2, 4), 10.0, dtype=torch.float16))  # 4 * 10 = 40, then 4 * 250 * 40
    assert out.max().item() == 40000.0  # finite, within 2x of float16's 65504
    assert hunt.findings == []
    kinds = {(w["kind"], w["module"]) for w in hunt.report.warnings}
    assert ("near_overflow", "1") in kinds


def test_geometric_growth_and_a_falling_loss_scale_are_warned():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    with nanhunt.watch(model, optimizer=opt, scaler=scaler, on_find="record", stats_every=1) as hunt:
        for k in range(6):
            with torch.no_grad():
                model[0].weight.mul_(4.0)  # the layer's output grows x4 per step
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.ones(2, 4))
            loss = F.mse_loss(out.float(), torch.zeros(2, 2)) * 1e4
            scaler.scale(loss).backward()  # huge scale: fp16 gradients overflow, the scaler backs off
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    kinds = {w["kind"] for w in hunt.report.warnings}
    assert "scale_falling" in kinds
    assert any(w["kind"] == "growth" and w["module"] == "0" for w in hunt.report.warnings)


class _BNThenInplaceReLU(nn.Module):
    """BatchNorm's output written in place after it returns (ReLU(inplace)): its row must be the
    BatchNorm's own numbers, not the ReLU's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(self.bn(self.lin(x)))


def test_sampled_statistics_are_each_calls_own_numbers():
    """The sampled rows are computed together at the top-level call's return: each must still be
    what the call returned (a container's row is its child's, a passthrough has its own)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Sequential(nn.Linear(6, 6)), _BNThenInplaceReLU(),
                          nn.Linear(6, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen: list[dict[str, torch.Tensor]] = []

    hunt = nanhunt.watch(model, optimizer=opt, on_find="record", history=8, stats_every=1)
    try:
        for _ in range(4):  # (the first: every module on trial; then the held ones, batched)
            ref = copy.deepcopy(model)  # an unwatched twin: what each call returns, from its hooks
            names = {m: n for n, m in ref.named_modules()}
            got: dict[str, torch.Tensor] = {}
            seen.append(got)
            for m in ref.modules():
                m.register_forward_hook(lambda m, a, out, got=got, names=names: got.__setitem__(names[m], out.detach().clone()))
            x = torch.randn(16, 4)
            ref(x)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        hist = hunt.report.history
    finally:
        hunt.close()
    assert len(hist["steps"]) == 4
    for col, outs in enumerate(seen):
        for name, out in outs.items():
            if name in ("", "3", "3.act"):  # (the ReLU writes the BatchNorm's tensor: theirs are its numbers after)
                continue
            i = hist["modules"].index(name)
            assert hist["absmax"][i][col] == pytest.approx(out.abs().max().item(), rel=1e-5), (name, col)
            assert hist["rms"][i][col] == pytest.approx(out.pow(2).mean().sqrt().item(), rel=1e-5), (name, col)


@pytest.mark.parametrize("threads", [1, 2])
def test_sampled_statistics_of_many_outputs_equal_each_outputs_own(threads):
    """A sampled step reads many same-shape outputs in one reduction per statistic; each row must
    be what that output's own statistics are: zeros (+0, -0) not counted, subnormals, infinities
    and NaN counted as non-zero."""
    from nanhunt._record.history import stats, stats_of_rows

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        ts = [torch.randn(32, 64) for _ in range(15)]
        ts[1][0, :7] = 0.0
        ts[2][3, :5] = -0.0
        ts[3][1, 1] = 1e-45  # a subnormal: non-zero
        ts[4][2, 2] = float("inf")
        ts[5][2, 3] = float("-inf")
        ts[6][4, 4] = float("nan")
        rows = stats_of_rows(ts)
        for t, row in zip(ts, rows):
            one = stats(t)
            assert row[3].item() == one[3].item() == torch.count_nonzero(t).item()
            assert torch.allclose(row[:3], one[:3], equal_nan=True)
        assert rows[1][3].item() == 32 * 64 - 7 and rows[2][3].item() == 32 * 64 - 5
        assert rows[6][3].item() == 32 * 64
    finally:
        torch.set_num_threads(before)


def test_a_sampled_step_with_a_row_still_unfilled_is_dropped_not_the_hunt():
    """A call another thread was still making when this thread's step() ended the step leaves its
    statistics row unfilled (None): that sample is left out of the history; the hunt goes on (it
    raised an internal error and switched itself off)."""
    from nanhunt._record.history import History

    h = History(4)
    row = torch.tensor([0.0, 1.0, 1.0, 2.0])
    h.add(0, [("a", "float32", 2), ("b", "float32", 2)], [row, 0])  # (b hands on a's output)
    h.add(1, [("a", "float32", 2), ("b", "float32", 2)], [row, None])
    h.add(2, [("a", "float32", 2), ("b", "float32", 2)], [row])
    assert [s for s, _, _ in h._ring] == [0]
    assert h.to_dict()["steps"] == [0]
