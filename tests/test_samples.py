"""watch(loader=...): the dataset indices of the rows that carried NaN, from a shuffled DataLoader."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import nanhunt
from tests import zoo

POISONED = {5, 17, 30}


class Records(Dataset):
    """40 records of 6 features; a few are corrupt (a NaN feature), as a bad row in a CSV would be."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(40, 6, generator=g)
        self.y = torch.randint(0, 3, (40,), generator=g)
        for i in POISONED:
            self.x[i, 1] = float("nan")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i  # the index too: the test's ground truth


def _loader(**kw: Any) -> DataLoader:
    return DataLoader(Records(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3), **kw)


def _skip_epoch(loader: DataLoader[Any], model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[nanhunt.Hunt, list[list[int]]]:
    """One epoch watched with on_find="skip" and ``loader=``: the hunt, and each step's dataset indices."""
    order = []
    with nanhunt.watch(model, opt, on_find="skip", loader=loader) as hunt:
        for x, y, i in loader:
            order.append(i.tolist())
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return hunt, order


@pytest.mark.parametrize("workers", [0, 2])
def test_bad_samples_are_named_from_a_shuffled_loader(workers: int) -> None:
    loader = _loader(num_workers=workers)
    model = zoo.bnmlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hunt, order = _skip_epoch(loader, model, opt)
    expected_steps = [s for s, b in enumerate(order) if POISONED & set(b)]
    assert len(order) == 10 and sorted(sum(order, [])) == list(range(40))
    assert hunt.skipped == expected_steps and len(expected_steps) >= 2
    assert hunt.report.bad_samples == sorted(POISONED)
    for f in hunt.findings:  # the data's rows for the forward finding; a weight's gradient has no rows
        expected = tuple(i for i in order[f.step] if i in POISONED) if f.phase == "forward" else ()
        assert f.samples == expected, f
    back = nanhunt.Report.from_dict(hunt.report.to_dict())
    assert back.bad_samples == sorted(POISONED) and back.findings[0].samples == hunt.findings[0].samples
    assert "bad samples: " + ", ".join(map(str, sorted(POISONED))) in str(hunt.report)
    # nothing of nanhunt's is left on the loader
    assert type(loader.batch_sampler).__name__ == "BatchSampler" and "_get_iterator" not in vars(loader)


def test_resume_without_the_bad_samples() -> None:
    """What the README says: drop report.bad_samples with a Subset, and the run is clean."""
    loader = _loader()
    model = zoo.bnmlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with nanhunt.watch(model, opt, on_find="skip", loader=loader) as hunt:
        for x, y, _ in loader:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    bad = set(hunt.report.bad_samples)
    clean = torch.utils.data.Subset(loader.dataset, [i for i in range(len(loader.dataset)) if i not in bad])
    with nanhunt.watch(model, opt) as again:
        for x, y, _ in DataLoader(clean, batch_size=4, shuffle=True, drop_last=True):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert again.first is None


def test_steps_after_the_bad_sample_poisoned_the_weights_name_no_sample_of_theirs() -> None:
    """Record mode: the NaN of record 13 poisons the weights at step 1; every later step's forward
    is non-finite by the weights (cause "parameter"), and each named its first row (16, 24) as a
    bad sample: README's Subset recipe then dropped healthy records."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
    x[13, 2] = float("nan")
    loader = DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nanhunt.watch(model, opt, on_find="record", loader=loader) as hunt:
        for xb, yb in loader:
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
            opt.zero_grad()
    poisoned = [f for f in hunt.findings if f.cause == "parameter"]
    assert poisoned and {f.step for f in poisoned} == {2, 3}, [str(f) for f in hunt.findings]
    assert all(f.samples == () for f in poisoned), [(f.step, f.samples) for f in poisoned]
    assert hunt.first is not None and hunt.first.samples == (13,) and hunt.report.bad_samples == [13]


def test_a_watch_per_epoch_names_the_rows_of_a_persistent_workers_loader() -> None:
    """One watch per epoch over a loader with persistent_workers=True: the epochs after the first
    reuse the iterator made while the first watch was open (no new `_get_iterator`), which kept
    that closed watch's sampler: every later watch had no samples, and the closed watch stayed
    referenced by the loader."""
    loader = _loader(num_workers=2, persistent_workers=True)
    model = zoo.bnmlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for epoch in range(2):
        hunt, order = _skip_epoch(loader, model, opt)
        assert hunt.report.bad_samples == sorted(POISONED), epoch
        f = next(f for f in hunt.findings if f.phase == "forward")
        assert f.samples == tuple(i for i in order[f.step] if i in POISONED), (epoch, f)
        it = loader._iterator
        assert type(it.__dict__["_index_sampler"]).__name__ == "BatchSampler" and "_nanhunt_indices" not in vars(it)


def test_loader_must_be_a_dataloader() -> None:
    with pytest.raises(TypeError, match="DataLoader"):
        nanhunt.watch(zoo.bnmlp(), loader=[1, 2, 3])


def test_batches_the_loader_did_not_deliver_name_no_rows_of_another_batch() -> None:
    # itertools.cycle(loader), an infinite loop that many scripts use, replays its first pass from
    # its own copies: the loader delivers nothing more, and a replayed bad batch was named by the
    # rows of the last batch it did deliver (row 37 for the NaN of row 29)
    import itertools

    loader = DataLoader(Records(), batch_size=4, shuffle=False)
    model = zoo.bnmlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanhunt.watch(model, opt, on_find="skip", loader=loader) as hunt:  # (the weights stay finite)
        it = itertools.cycle(loader)
        for _ in range(14):  # 10 delivered batches, then 4 of cycle's copies (rows 0-15)
            x, y, _i = next(it)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        # one batch the loader delivered (rows 4-7), trained on for two steps: its rows both times
        again = iter(loader)
        next(again)
        x, y, _i = next(again)
        for by_keyword in (False, True):  # (by keyword too: model(x=x))
            F.cross_entropy(model(x=x) if by_keyword else model(x), y).backward()
            opt.step()
            opt.zero_grad()
    forward = {f.step: f.samples for f in hunt.findings if f.phase == "forward"}
    assert forward[1] == (5,) and forward[4] == (17,) and forward[7] == (30,)  # delivered: their rows
    assert forward[11] == ()  # cycle's copy of batch 1 (rows 4-7): unknown, never the rows of batch 9
    assert forward[14] == forward[15] == (5,)
    assert hunt.report.bad_samples == sorted(POISONED)


class Standardized(torch.nn.Module):
    """Each record standardized by its own std in the model's forward, then the BatchNorm MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.net = zoo.bnmlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True))


def test_rows_of_a_nan_born_in_the_model_are_those_of_its_op_not_of_the_batchnorm_that_spread_it() -> None:
    # a blank record (std 0) gives 0/0 in the model's own forward; BatchNorm's batch statistics then
    # carry the NaN into every row of the output: the finding named the output's first row, another
    # record of the batch, instead of the row the division made non-finite
    data = Records()
    data.x = torch.nan_to_num(data.x)
    blank = {6, 21}
    for i in blank:
        data.x[i] = 0.5
    loader = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    model = Standardized()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    order = []
    with nanhunt.watch(model, opt, on_find="skip", loader=loader, max_skips=10) as hunt:
        for x, y, i in loader:
            order.append(i.tolist())
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    forward = [f for f in hunt.findings if f.phase == "forward"]
    assert [f.step for f in forward] == [s for s, b in enumerate(order) if blank & set(b)]
    for f in forward:
        assert f.module == "" and f.op == "aten.div.Tensor" and f.cause == "created"
        assert f.samples == tuple(i for i in order[f.step] if i in blank), (f.samples, order[f.step])
    assert hunt.report.bad_samples == sorted(blank)


class Pairs(Dataset):
    """Siamese pairs (two halves of 2 features); in a few, both halves are the same image."""

    def __init__(self, same: set[int]) -> None:
        self.x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
        for i in same:
            self.x[i, 2:] = self.x[i, :2]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_every_row_of_a_nan_born_in_the_backward_is_named(mode: str) -> None:
    # sqrt's gradient at a distance of 0 (identical halves) is inf * 0 = nan in the backward: three
    # such pairs in one batch were named by the first bad element's row alone (rows 1 of 1, 2, 3)
    same = {1, 2, 3, 9}
    loader = DataLoader(Pairs(same), batch_size=4)
    model = zoo.distnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanhunt.watch(model, opt, on_find="skip", loader=loader, mode=mode) as hunt:
        for x in loader:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    back = {f.step: f.samples for f in hunt.findings if f.phase == "backward"}
    assert back == {0: (1, 2, 3), 2: (9,)}, hunt.findings
    assert hunt.report.bad_samples == sorted(same)


@pytest.mark.parametrize("grad_off", ["no_grad", "inference_mode"])
def test_an_inference_loop_names_the_batch_that_holds_the_nan_not_the_one_before(grad_off: str) -> None:
    """watch(model, loader=...) with no optimizer over a validation set whose record 13 holds a NaN.
    Between two forwards no step() turns the outside recorder off: the DataLoader's collate
    (torch.stack of the next batch) was recorded as loss code of the step before, an '<outside>'
    finding at step 0 naming row 5 of the clean first batch, and bad_samples held 5."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 6, generator=g)
    x[13, 2] = float("nan")
    loader = DataLoader(torch.utils.data.TensorDataset(x), batch_size=8)
    model = zoo.bnmlp().eval()
    with nanhunt.watch(model, on_find="record", loader=loader) as hunt:
        for (xb,) in loader:
            with getattr(torch, grad_off)():
                model(xb).softmax(-1)
    f = hunt.first
    assert f is not None and (f.phase, f.module, f.cause, f.step, f.samples) == ("forward", "fc1", "input", 1, (13,)), f
    assert hunt.report.bad_samples == [13]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("mechanism", ["sqrt's gradient at 0", "NaN feature"])
def test_accumulated_micro_batch_names_its_own_samples_not_the_last_ones(mode: str, mechanism: str) -> None:
    """Four micro-batches a step, the 3rd one's record 9 bad: a gradient born in its backward (both
    modes), and a forward finding in sentinel mode, named the rows of the step's last micro-batch
    (record 13) as the bad samples: README's Subset recipe dropped a healthy record, kept the bad one."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)
    if mechanism == "NaN feature":
        x[9, 0] = float("nan")
    else:
        x[9, 2:] = x[9, :2]  # equal halves: a distance of exactly 0
    loader = DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    model = zoo.distnet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(model, opt, mode=mode, loader=loader):
            for i, (xb, yb) in enumerate(loader):
                (F.mse_loss(model(xb), yb) / 4).backward()
                if i % 4 == 3:
                    opt.step()
                    opt.zero_grad()
    f = ei.value.finding
    # (proj runs twice a micro-batch: its 3rd micro-batch's first call is its call 4)
    expected = ("forward", "proj", 4) if mechanism == "NaN feature" else ("backward", "dist", 2)
    assert (f.phase, f.module, f.call, f.step) == (*expected, 0), f
    assert f.samples == (9,) and ei.value.report.bad_samples == [9], f


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_accelerates_prepared_loader_names_the_bad_samples(mode: str) -> None:
    """accelerate's prepare(loader) gives a DataLoaderShard that iterates a DataLoader of its own,
    one batch ahead of what it yields: watch(loader=prepared) named no sample at all (its own sampler
    and iterator are never used). The last batch (yielded after the inner loader ran out) too."""
    accelerate = pytest.importorskip("accelerate")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g)
    bad = [5, 17, 38]  # batches 1, 4 and 9, the last
    x[bad, 1] = float("nan")
    acc = accelerate.Accelerator(cpu=True)
    model = zoo.bnmlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, loader = acc.prepare(model, opt, DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4))
    with nanhunt.watch(model, opt, mode=mode, on_find="skip", loader=loader) as hunt:
        for xb, yb in loader:
            acc.backward(F.cross_entropy(model(xb), yb))
            opt.step()
            opt.zero_grad()
    assert hunt.skipped == [1, 4, 9] and hunt.report.bad_samples == bad
    assert [f.samples for f in hunt.findings if f.phase == "forward"] == [(5,), (17,), (38,)]
    inner = loader.base_dataloader  # nothing of nanhunt's is left on it
    assert type(inner.batch_sampler).__name__ == "BatchSampler" and "_get_iterator" not in vars(inner)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_loader_before_accelerates_prepare_is_told_and_left_working() -> None:
    """watch(loader=the original) before prepare(): accelerate builds its loader from the original's
    batch sampler (nanhunt's recording one), and the loop iterates that: samples stayed empty with no
    word, and after close() the prepared loader still fed nanhunt's queue."""
    accelerate = pytest.importorskip("accelerate")
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g))
    original = DataLoader(data, batch_size=4)
    model = zoo.bnmlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    acc = accelerate.Accelerator(cpu=True)
    hunt = nanhunt.watch(model, opt, loader=original)
    model, opt, loader = acc.prepare(model, opt, original)
    with hunt, pytest.warns(UserWarning, match=r"Give watch\(\) the loader the loop iterates") as told:
        for xb, yb in loader:
            acc.backward(F.cross_entropy(model(xb), yb))
            opt.step()
            opt.zero_grad()
    assert len([w for w in told if "watch(loader=" in str(w.message)]) == 1  # once, not every step
    assert type(original.batch_sampler).__name__ == "BatchSampler"
    assert [len(xb) for xb, _ in loader] == [4, 4, 4, 4]  # the recording sampler accelerate kept only hands on
    assert not loader.base_dataloader.batch_sampler._nanhunt_owner.queue


class Targets(Dataset):
    """Regression rows whose features are all fine; one row's target is missing (a CSV's empty cell
    parsed as NaN): the model is fine, the loss code is fed the NaN."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(32, 4, generator=g)
        self.y = torch.randn(32, 1, generator=g)
        self.y[21, 0] = float("nan")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def test_a_nan_target_names_its_sample_at_the_loss() -> None:
    loader = DataLoader(Targets(), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))
    model = zoo.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    with pytest.raises(nanhunt.NonFiniteError) as err:
        with nanhunt.watch(model, opt, loader=loader):
            for x, y in loader:
                seen.append(y)
                F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    f = err.value.finding
    assert (f.module, f.cause, f.shape) == ("<outside>", "input", ())  # the scalar loss, fed the target's NaN
    assert f.step == len(seen) - 1 and not torch.isfinite(seen[-1]).all()
    assert f.samples == (21,) and err.value.report.bad_samples == [21]
