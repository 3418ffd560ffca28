"""The checkpoint guard: torch.save refuses non-finite model or optimizer state while a hunt is open."""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import hashlib
import io
import os
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import nanhunt
from tests import zoo


def _digest(p: Any) -> tuple[str, int]:
    with open(p, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest(), os.stat(p).st_mtime_ns


def _blow_up(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """A corrupt record in the batch; with on_find="record" the update goes through: NaN weights and momentum."""
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    x[3, 2] = float("nan")
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def test_refuses_before_a_byte_is_written_and_keeps_the_old_file(tmp_path: Any) -> None:
    model = zoo.bnmlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict()}, path)
    before = _digest(path)
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        _blow_up(model, opt)
        with pytest.raises(nanhunt.NonFiniteError) as ei:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1}, path)
    f = ei.value.finding
    assert (f.phase, f.module, f.tensor) == ("checkpoint", str(path), "['model']['fc1.weight']")
    assert _digest(path) == before
    assert f in hunt.findings


def test_copies_are_judged_too(tmp_path: Any) -> None:
    model = zoo.bnmlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with nanhunt.watch(model, opt, on_find="record"):
        _blow_up(model, opt)
        with pytest.raises(nanhunt.NonFiniteError) as ei:
            torch.save({"state": copy.deepcopy(model.state_dict())}, tmp_path / "a.pt")
        assert ei.value.finding.tensor == "['state']['fc1.weight']"
        with pytest.raises(nanhunt.NonFiniteError) as ei:
            torch.save(copy.deepcopy(opt.state_dict()), tmp_path / "b.pt")
        assert ei.value.finding.tensor.startswith("['state'][0]")
    assert not (tmp_path / "a.pt").exists() and not (tmp_path / "b.pt").exists()


def test_a_state_keyed_by_the_parameters_names_the_parameter_not_its_values(tmp_path: Any) -> None:
    """``torch.save(opt.state)`` (a dict keyed by the parameters themselves) after a huge gradient
    overflowed Adam's ``exp_avg_sq``: the key path was the repr of the whole Parameter (every
    value, over many lines) in the error's one-paragraph summary and in the finding's ``tensor``."""
    model = zoo.bnmlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanhunt.watch(model, opt, on_find="record"):
        x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
        (F.cross_entropy(model(x), y) * 1e25).backward()  # squared past float32's range
        opt.step()
        assert all(torch.isfinite(p).all() for p in model.parameters())
        with pytest.raises(nanhunt.NonFiniteError) as ei:
            torch.save(opt.state, tmp_path / "state.pt")
    assert ei.value.finding.tensor == "[<fc1.weight>]['exp_avg_sq']"
    assert "\n" not in str(ei.value) and not (tmp_path / "state.pt").exists()
    keyed = {torch.ones(2, 3): {"x": torch.tensor([float("nan")])}}
    assert [f.tensor for f in nanhunt.audit(keyed)] == ["[<Tensor (2, 3)>]['x']"]


def test_sentinels_and_masks_are_not_judged(tmp_path: Any) -> None:
    model = zoo.bnmlp()
    model.register_buffer("mask", torch.tensor([0.0, float("-inf")]))  # intended, already there at watch()
    # a mask kept as a frozen parameter (never trained: a constant, as a buffer is)
    model.pmask = torch.nn.Parameter(torch.tensor([float("-inf"), 0.0]), requires_grad=False)
    opt = torch.optim.AdamW(model.parameters())
    with nanhunt.watch(model, opt):
        F.cross_entropy(model(torch.randn(4, 6)), torch.tensor([0, 1, 2, 0])).backward()
        opt.step()  # a clean step first: the masks were noted when it began
        torch.save({"state_dict": model.state_dict(), "callbacks": {"kth_value": torch.tensor(float("inf"))},
                    "user": torch.full((2,), float("nan"))}, tmp_path / "ok.pt")
    assert torch.load(tmp_path / "ok.pt", weights_only=True)["state_dict"]["mask"][1] == float("-inf")
    assert torch.load(tmp_path / "ok.pt", weights_only=True)["state_dict"]["pmask"][0] == float("-inf")


class _LazyMask(torch.nn.Module):
    """Attention whose causal mask buffer is built on first use, for the longest sequence seen."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.qkv, self.o = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.register_buffer("mask", torch.empty(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if self.mask.shape[-1] < t:
            self.mask = torch.full((t, t), float("-inf")).triu(1)
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.o(((q @ k.transpose(-1, -2)) / 8 ** 0.5 + self.mask[:t, :t]).softmax(-1) @ v)


def test_a_mask_buffer_the_model_builds_itself_is_not_judged_in_a_clean_run(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(_LazyMask(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nanhunt.watch(model, opt) as hunt:
        for i in range(3):  # a longer sequence each time: the mask is built again
            model(torch.randn(2, 4 + 2 * i, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
            torch.save(copy.deepcopy(model.state_dict()), tmp_path / "copy.pt")
        assert hunt.findings == []
        assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"]["0.mask"].shape == (8, 8)
        # once the run is poisoned the model's state is judged whole again: NaN weights are refused
        with torch.no_grad():
            model[1].weight.fill_(float("nan"))
        model(torch.randn(2, 8, 8)).pow(2).mean().backward()
        with pytest.raises(nanhunt.NonFiniteError):
            opt.step()
        with pytest.raises(nanhunt.NonFiniteError) as ei:
            torch.save({"model": model.state_dict()}, tmp_path / "bad.pt")
    assert ei.value.finding.phase == "checkpoint" and not (tmp_path / "bad.pt").exists()


def test_torch_serialization_save_is_guarded_too_and_put_back(tmp_path: Any) -> None:
    original = torch.serialization.save
    model = zoo.bnmlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    path = tmp_path / "ckpt.pt"
    with nanhunt.watch(model, opt, on_find="record"):
        _blow_up(model, opt)
        with pytest.raises(nanhunt.NonFiniteError) as ei:
            torch.serialization.save({"model": model.state_dict()}, path)
    assert ei.value.finding.tensor == "['model']['fc1.weight']" and not path.exists()
    assert torch.serialization.save is original and torch.save is original


def test_guard_saves_false_and_torch_save_restored_with_two_hunts(tmp_path: Any) -> None:
    original = torch.save
    a, b = zoo.bnmlp(), zoo.bnmlp()
    ha = nanhunt.watch(a, on_find="record")
    hb = nanhunt.watch(b, on_find="record")
    assert torch.save is not original
    ha.close()
    assert torch.save is not original  # hb is still open
    with torch.no_grad():
        b.fc1.weight[0, 0] = float("nan")
    with pytest.raises(nanhunt.NonFiniteError):
        torch.save(b.state_dict(), tmp_path / "b.pt")
    torch.save(a.state_dict(), tmp_path / "a.pt")  # a's hunt is closed
    hb.close()
    assert torch.save is original
    with nanhunt.watch(b, guard_saves=False):
        assert torch.save is original
        torch.save(b.state_dict(), tmp_path / "b.pt")
    assert torch.save is original


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_lightning_checkpoint_that_would_hold_nan_is_refused(tmp_path: Any) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from nanhunt.integrations.lightning import NanHunt

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = zoo.bnmlp()

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 6, generator=g)
    x[9, 4] = float("nan")  # a corrupt record in the third batch: with on_find="record" it is trained on
    ds = torch.utils.data.TensorDataset(x, torch.randint(0, 3, (32,), generator=g))
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=1, filename="{step}")
    hunt = NanHunt(on_find="record")
    trainer = pl.Trainer(max_steps=6, callbacks=[hunt, ckpt], accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        trainer.fit(Net(), torch.utils.data.DataLoader(ds, batch_size=4))
    f = ei.value.finding
    assert f.phase == "checkpoint" and f.tensor.startswith("['state_dict']['net.")
    assert f.module == str(tmp_path / "step=3.ckpt")
    assert "save_checkpoint" not in vars(trainer)
    written = sorted(os.listdir(tmp_path))
    assert written == ["step=1.ckpt", "step=2.ckpt"]  # each clean one (with its kth_value=inf sentinel)
    for name in written:
        assert nanhunt.audit(tmp_path / name) == []
    assert torch.save.__module__ == "torch.serialization"  # the guard left with the fit


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_hf_trainer_checkpoint_that_would_hold_nan_is_refused(tmp_path: Any) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from nanhunt.integrations.transformers import NanHuntCallback

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    tokens = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(0))
    ds = [{"input_ids": t, "labels": t} for t in tokens]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, save_strategy="steps", save_steps=1, logging_strategy="no",
                             disable_tqdm=True, learning_rate=1e30, optim="sgd", lr_scheduler_type="constant",
                             max_grad_norm=0.0)
    cb = NanHuntCallback(on_find="record")  # lr 1e30: step 1 overflows, its update makes the weights NaN
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        trainer.train()
    f = ei.value.finding
    assert f.phase == "checkpoint" and f.module == os.path.join(str(tmp_path), "checkpoint-2")
    assert f.tensor.startswith("['model']['transformer.")
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1"]
    assert cb.hunt is not None and cb.hunt.closed


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_lightning_skip_drops_the_poisoned_step_and_checkpoints_stay_clean(tmp_path: Any) -> None:
    """Lightning runs forward and backward inside optimizer.step(closure): the skip happens there."""
    pl = pytest.importorskip("lightning.pytorch")
    from nanhunt.integrations.lightning import NanHunt

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = zoo.bnmlp()

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 6, generator=g)
    x[9, 4] = float("nan")  # the third batch
    ds = torch.utils.data.TensorDataset(x, torch.randint(0, 3, (32,), generator=g))
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=1, filename="{step}")
    hunt = NanHunt(on_find="skip")
    trainer = pl.Trainer(max_steps=6, callbacks=[hunt, ckpt], accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    net = Net()
    trainer.fit(net, torch.utils.data.DataLoader(ds, batch_size=4))
    assert hunt.hunt is not None and hunt.hunt.skipped == [2] and trainer.global_step == 6
    assert all(torch.isfinite(t).all() for t in net.state_dict().values())
    assert len(os.listdir(tmp_path)) == 6 and all(nanhunt.audit(tmp_path / n) == [] for n in os.listdir(tmp_path))


def test_refused_saves_count_against_max_findings(tmp_path: Any) -> None:
    """A loop that keeps trying to save a poisoned model (every epoch) does not grow the findings
    past ``max_findings``: the refusals past it are counted, and every save is still refused."""
    model = zoo.bnmlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with nanhunt.watch(model, opt, on_find="record", max_findings=3) as hunt:
        _blow_up(model, opt)
        before = len(hunt.findings) + hunt.report.meta["dropped_findings"]
        for epoch in range(6):
            with pytest.raises(nanhunt.NonFiniteError):
                torch.save(model.state_dict(), tmp_path / f"e{epoch}.pt")
        assert len(hunt.findings) == 3
        assert hunt.report.meta["dropped_findings"] == before + 6 - 3
    assert not any(tmp_path.iterdir())


def test_findings_stay_in_order_of_occurrence_around_a_refused_checkpoint(tmp_path: Any) -> None:
    # record mode: the poisoned update of step 0 is read at the next step's sync, after the
    # checkpoint of step 1 was refused; it still comes before it
    model = zoo.bnmlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        _blow_up(model, opt)
        with pytest.raises(nanhunt.NonFiniteError):
            torch.save(model.state_dict(), tmp_path / "ckpt.pt")
        _blow_up(model, opt)
    steps = [f.step for f in hunt.findings]
    assert steps == sorted(steps), [(f.step, f.phase) for f in hunt.findings]
    phases = [f.phase for f in hunt.findings]
    assert phases.index("optimizer") < phases.index("checkpoint")
    assert hunt.findings[phases.index("optimizer")].step == 0


@pytest.mark.parametrize("on_find", ["raise", "record"])
def test_a_refused_checkpoint_in_sentinel_mode_first_finds_the_update_that_made_it(on_find: str, tmp_path: Any) -> None:
    # an infinite learning rate at step 3 (a schedule that divided by 0), a checkpoint after every
    # step: sentinel reads the update every 10th step, so the refusal came first and alone
    # ('checkpoint', unknown), where full mode names the update. A refused save is a hit: the
    # update not read yet is judged first, and in raise mode it is what raises
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model, opt, mode="sentinel", on_find=on_find) as hunt:
        for step in range(6):
            opt.param_groups[0]["lr"] = float("inf") if step == 3 else 0.1
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            torch.save(model.state_dict(), tmp_path / f"s{step}.pt")
    first = hunt.findings[0]
    assert (first.phase, first.module, first.tensor, first.step, first.cause) == ("optimizer", "", "weight", 3, "created"), \
        str(first)
    assert ei.value.finding.phase == ("optimizer" if on_find == "raise" else "checkpoint")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s0.pt", "s1.pt", "s2.pt"]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("on_find", ["skip", "raise"])
def test_a_checkpoint_after_a_gradscaler_skipped_iteration_judges_that_iteration_first(
        on_find: str, mode: str, tmp_path: Any) -> None:
    # a GradScaler not given to watch() skipped opt.step() on a batch with a NaN record; its
    # forward wrote NaN into the BatchNorm running stats, and the loop saves a checkpoint after each
    # iteration. nanhunt judges such an iteration at the model's next call; the refusal came first:
    # skip mode stopped the run with a "checkpoint" error (its state was clean once the step was
    # dropped), and in full raise mode the checkpoint, not the forward, was the first finding
    torch.manual_seed(0)
    model = zoo.bnmlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(5)]
    batches[2][0][3, 1] = float("nan")
    raised = []
    with nanhunt.watch(model, opt, on_find=on_find, mode=mode) as hunt:
        for i, (x, y) in enumerate(batches):
            try:
                scaler.scale(F.cross_entropy(model(x), y)).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                torch.save(model.state_dict(), tmp_path / f"s{i}.pt")
            except nanhunt.NonFiniteError as e:
                raised.append((i, e.finding.phase))
                opt.zero_grad()
    assert hunt.first is not None and (hunt.first.phase, hunt.first.step) == ("forward", 2), str(hunt.first)
    if on_find == "skip":
        assert raised == [] and hunt.skipped == [2] and hunt.step == 5
        assert sorted(p.name for p in tmp_path.iterdir()) == [f"s{i}.pt" for i in range(5)]
        assert nanhunt.audit(tmp_path / "s2.pt") == []
    else:
        assert raised == [(2, "forward")]
    assert torch.isfinite(model.bn.running_mean).all() and torch.isfinite(model.bn.running_var).all()


@dataclasses.dataclass
class _TrainState:
    model: Any
    step: int


class _Slotted:
    __slots__ = ("weights",)

    def __init__(self, weights: Any) -> None:
        self.weights = weights


def test_state_held_in_objects_is_judged_too(tmp_path: Any) -> None:
    """``torch.save(TrainState(model=model.state_dict(), step=3))``: a dataclass, a
    ``SimpleNamespace``, an object with ``__slots__`` are "any structure" too; their fields are
    named as attributes in the key path. A finite object of the same kind saves unchanged."""
    model = zoo.bnmlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    path = tmp_path / "state.pt"
    with nanhunt.watch(model, opt, on_find="record"):
        torch.save(_TrainState(model.state_dict(), 0), path)  # finite: written
        assert torch.load(path, weights_only=False).step == 0
        before = _digest(path)
        _blow_up(model, opt)
        cases = [(_TrainState(model.state_dict(), 3), ".model['fc1.weight']"),
                 (types.SimpleNamespace(run=types.SimpleNamespace(sd=model.state_dict())), ".run.sd['fc1.weight']"),
                 ({"ema": _Slotted(model.state_dict())}, "['ema'].weights['fc1.weight']")]
        for obj, key in cases:
            with pytest.raises(nanhunt.NonFiniteError) as ei:
                torch.save(obj, path)
            assert ei.value.finding.tensor == key
            assert _digest(path) == before


_SEEN: list[int] = []


def _user_hook(module: Any, args: Any, output: Any) -> None:
    _SEEN.append(1)


def _user_noop_hook(module: Any, args: Any, output: Any) -> None:
    return None


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_whole_module_saved_while_watched_carries_no_nanhunt_hook(mode: str) -> None:
    """``torch.save(model)`` pickles the module's hook dicts: sentinel's root hooks (and full
    mode's late hook behind a user's forward hook) went into the file, so the loaded model carried
    no-op hooks and loading needed nanhunt. They step aside while torch.save runs, then go back in
    their place (the user's hook keeps its order)."""
    torch.manual_seed(0)
    model = zoo.bnmlp()
    _SEEN.clear()
    model.register_forward_hook(_user_hook)  # the user's own hooks (picklable)
    model.fc1.register_forward_hook(_user_noop_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 6)
    with nanhunt.watch(model, opt, mode=mode) as hunt:
        model(x).sum().backward()
        opt.step()
        orders = {n: [list(d) for d in (m._forward_pre_hooks, m._forward_hooks)] for n, m in model.named_modules()}
        buf = io.BytesIO()
        torch.save(model, buf)
        assert {n: [list(d) for d in (m._forward_pre_hooks, m._forward_hooks)]
                for n, m in model.named_modules()} == orders
        assert hunt.module_hook_handles()  # the hunt did hook the user's modules ...
        data = buf.getvalue()
        assert b"nanhunt" not in data  # ... but none of it is in the file
        loaded = torch.load(io.BytesIO(data), weights_only=False)
        assert len(loaded._forward_hooks) == 1 and not loaded._forward_pre_hooks
        model(x)  # the hunt still sees the root's calls
    assert _SEEN == [1, 1] and hunt.findings == []


def test_a_poisoned_state_nested_deep_in_the_saved_object_is_refused(tmp_path: Any) -> None:
    """The save guard walks as deep as the object goes (it stopped at 64 levels and wrote the file)."""
    model = zoo.bnmlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    path = tmp_path / "ckpt.pt"
    with nanhunt.watch(model, opt, on_find="record"):
        _blow_up(model, opt)
        obj: Any = {"model": model.state_dict()}
        for _ in range(100):
            obj = {"run": obj}
        with pytest.raises(nanhunt.NonFiniteError) as ei:
            torch.save(obj, path)
    # (the key path's middle is cut past 32 levels: its two ends say where)
    assert ei.value.finding.tensor == "['run']" * 16 + "…70 levels…" + "['run']" * 14 + "['model']['fc1.weight']"
    assert not path.exists()


def _sparse(layout: str, v: float) -> torch.Tensor:
    """A 2x2 sparse tensor holding ``v`` at [0, 1] (uncoalesced: stored after [1, 0], and twice)."""
    if layout == "coo_uncoalesced":
        return torch.sparse_coo_tensor([[1, 0, 0], [0, 1, 1]], [2.0, v, 1.0], (2, 2), check_invariants=True)
    dense = torch.tensor([[0.0, v], [2.0, 0.0]])
    return dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()


def _poison(t: torch.Tensor) -> None:
    """NaN where ``_sparse`` put ``3.0``, in place (as an update would)."""
    with torch.no_grad():
        v = t._values() if t.layout is torch.sparse_coo else t.values()
        v[v == 3.0] = float("nan")


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning")
@pytest.mark.parametrize("layout", ["coo", "csr", "coo_uncoalesced"])
def test_a_sparse_parameter_gone_nan_is_refused(layout: str, tmp_path: Any) -> None:
    """A sparse parameter's NaN was never judged (only strided tensors were): the checkpoint was written."""
    model = zoo.bnmlp()
    model.emb = torch.nn.Parameter(_sparse(layout, 3.0))  # e.g. a sparse embedding table, trained elsewhere
    opt = torch.optim.SGD([p for n, p in model.named_parameters() if n != "emb"], lr=0.1, momentum=0.9)
    path = tmp_path / "ckpt.pt"
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        F.cross_entropy(model(torch.randn(4, 6)), torch.tensor([0, 1, 2, 0])).backward()
        opt.step()
        torch.save({"model": model.state_dict()}, path)  # clean: written
        _poison(model.emb)
        before = _digest(path)
        for obj, where in (({"model": model.state_dict()}, "['model']['emb']"), ({"table": model.emb}, "['table']")):
            with pytest.raises(nanhunt.NonFiniteError) as ei:
                torch.save(obj, path)
            f = ei.value.finding
            assert (f.phase, f.tensor, f.index, f.shape) == ("checkpoint", where, (0, 1), (2, 2)), where
            assert f.counts == {"nan": 1, "+inf": 0, "-inf": 0}
        assert _digest(path) == before
        assert not hunt.closed


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning")
@pytest.mark.parametrize("layout", ["coo", "csr", "coo_uncoalesced"])
def test_a_sparse_mask_non_finite_at_watch_is_not_judged(layout: str, tmp_path: Any) -> None:
    """A sparse ``-inf`` buffer present at watch() is an intended mask, as a dense one is; a sparse
    parameter beside it that goes NaN is still refused."""
    model = zoo.bnmlp()
    model.register_buffer("mask", _sparse(layout, float("-inf")))
    model.emb = torch.nn.Parameter(_sparse(layout, 3.0))
    with nanhunt.watch(model, torch.optim.SGD(model.parameters(), lr=0.1)):
        torch.save(model.state_dict(), tmp_path / "ok.pt")
        _poison(model.emb)
        with pytest.raises(nanhunt.NonFiniteError) as ei:
            torch.save(model.state_dict(), tmp_path / "bad.pt")
    assert ei.value.finding.tensor == "['emb']"
    assert torch.load(tmp_path / "ok.pt", weights_only=True)["mask"].to_dense()[0, 1] == float("-inf")
    assert not (tmp_path / "bad.pt").exists()


class _RaisingMapping(collections.abc.Mapping):  # type: ignore[type-arg]
    """A mapping whose values come from somewhere that is down (pickled as an empty dict)."""

    def __getitem__(self, k: Any) -> Any:
        raise RuntimeError("remote store down")

    def __iter__(self) -> Any:
        return iter(["a"])

    def __len__(self) -> int:
        return 1

    def __reduce__(self) -> Any:
        return (dict, ())


class _HugeMapping(collections.abc.Mapping):  # type: ignore[type-arg]
    """A lazy mapping of a billion keys (pickled as an empty dict)."""

    def __getitem__(self, k: Any) -> Any:
        return 0

    def __iter__(self) -> Any:
        return iter(range(10**9))

    def __len__(self) -> int:
        return 10**9

    def __reduce__(self) -> Any:
        return (dict, ())


class _NoStateDict(torch.nn.Module):
    """A module whose state_dict() needs something it does not have (a sharded model's process group)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.calls = 0

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        raise RuntimeError("state_dict needs a process group")


class _Refusing(torch.Tensor):
    """A tensor subclass that refuses to show its storage."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.untyped_storage:
            raise TypeError("no storage for you")
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning")
@pytest.mark.parametrize("extra", ["raising mapping", "billion keys", "module without state_dict", "nested tensor",
                                   "subclass refusing its storage"])
def test_an_object_the_guard_cannot_walk_is_saved_as_unwatched(extra: str) -> None:
    """The guard made valid saves fail: a nested tensor (no shape: RuntimeError), a mapping that
    raises, a module whose state_dict() raises (and every module's state_dict() was called once
    more per save), a tensor subclass raising TypeError for its storage; a lazy mapping of a
    billion keys hung the save. What it cannot walk it leaves unjudged; the save goes on as it
    would unwatched, byte for byte; the model's own state is still judged."""
    torch.manual_seed(0)
    model = zoo.bnmlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    odd = {"raising mapping": _RaisingMapping, "billion keys": _HugeMapping, "module without state_dict": _NoStateDict,
           "nested tensor": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
           "subclass refusing its storage": lambda: torch.ones(3).as_subclass(_Refusing)}[extra]()

    def save() -> bytes:
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "odd": odd}, buf)
        return buf.getvalue()

    unwatched = save()
    with nanhunt.watch(model, opt) as hunt:
        assert save() == unwatched
        if isinstance(odd, _NoStateDict):
            assert odd.calls == 0  # (a sharded model's state_dict() gathers across ranks: not on one rank's save)
        with torch.no_grad():
            model.fc1.weight[0, 0] = float("nan")
        with pytest.raises(nanhunt.NonFiniteError, match="refused"):
            save()
    assert [f.phase for f in hunt.findings] == ["checkpoint"]


def test_safetensors_writers_imported_by_name_are_guarded_too(tmp_path: Any) -> None:
    """Hugging Face, accelerate and many loops write checkpoints with safetensors, whose writers
    are imported by name before any watch() (``from safetensors.torch import save_file``)."""
    st = pytest.importorskip("safetensors.torch")
    from safetensors.torch import save_file, save_model

    original = {n: getattr(st, n) for n in ("_flatten_as_ptr", "_flatten") if hasattr(st, n)}
    model = zoo.bnmlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    path = tmp_path / "model.safetensors"
    save_file(model.state_dict(), str(path))
    before = _digest(path)
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        clean = tmp_path / "clean.safetensors"
        save_file(model.state_dict(), str(clean))  # a clean save is written as unwatched
        assert clean.read_bytes() == st.save(model.state_dict())
        _blow_up(model, opt)
        with pytest.raises(nanhunt.NonFiniteError) as ei:
            save_file(model.state_dict(), str(path))
        with pytest.raises(nanhunt.NonFiniteError) as em:
            save_model(model, str(tmp_path / "whole.safetensors"))
        with pytest.raises(nanhunt.NonFiniteError) as eb:
            st.save({"w": model.fc1.weight.detach().clone()})  # a copy under its own name: not state
            st.save(model.state_dict())
    f = ei.value.finding
    assert (f.phase, f.module, f.tensor) == ("checkpoint", str(path), "['fc1.weight']")
    assert _digest(path) == before and not (tmp_path / "whole.safetensors").exists()
    assert em.value.finding.module == str(tmp_path / "whole.safetensors")
    assert eb.value.finding.module == "<safetensors bytes>"
    assert f in hunt.findings
    assert {n: getattr(st, n) for n in original} == original  # put back at close
    save_file(model.state_dict(), str(path))  # unwatched again: written, NaN and all
    assert _digest(path) != before


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_accelerate_save_state_writes_no_half_checkpoint(tmp_path: Any) -> None:
    """accelerate's save_state writes the model with safetensors, then the optimizer with
    torch.save: a poisoned model must not leave model.safetensors behind."""
    accelerate = pytest.importorskip("accelerate")
    model = zoo.bnmlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = accelerate.Accelerator(cpu=True)
    model, opt = acc.prepare(model, opt)
    with nanhunt.watch(model, opt, on_find="record"):
        acc.save_state(str(tmp_path / "good"))
        assert (tmp_path / "good" / "model.safetensors").exists()
        _blow_up(model, opt)
        with pytest.raises(nanhunt.NonFiniteError) as ei:
            acc.save_state(str(tmp_path / "bad"))
    assert ei.value.finding.module == str(tmp_path / "bad")
    assert not any(p.is_file() for p in (tmp_path / "bad").rglob("*"))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_accelerate_save_state_of_two_models_is_judged_whole(tmp_path: Any) -> None:
    """A GAN under accelerate: save_state writes G's file, then D's. D poisoned (its own hunt):
    nothing of the checkpoint is written, not G's file alone."""
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    g, d = torch.nn.Sequential(torch.nn.Linear(8, 4)), torch.nn.Sequential(torch.nn.Linear(4, 1))
    og, od = torch.optim.SGD(g.parameters(), 0.1), torch.optim.SGD(d.parameters(), 0.1)
    acc = accelerate.Accelerator(cpu=True)
    g, d, og, od = acc.prepare(g, d, og, od)
    with nanhunt.watch(g, og, on_find="record"), nanhunt.watch(d, od, on_find="record"):
        with torch.no_grad():
            d[0].weight[0, 1] = float("nan")
        with pytest.raises(nanhunt.NonFiniteError) as ei:
            acc.save_state(str(tmp_path / "bad"))
    assert ei.value.finding.tensor == "[1]['0.weight']"  # (the second model given to prepare)
    assert not (tmp_path / "bad").exists() or not any(p.is_file() for p in (tmp_path / "bad").rglob("*"))
    acc.save_state(str(tmp_path / "after"))  # unwatched again: written as it would be
    assert (tmp_path / "after" / "model_1.safetensors").exists()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sharded_save_pretrained_over_a_good_checkpoint_leaves_it_intact(tmp_path: Any) -> None:
    """save_pretrained writes its config, then one shard after another: a NaN in the last shard
    must not leave the first shards overwritten with the new state over the last good checkpoint
    (a mix of two training steps that loads without error)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = tmp_path / "last"
    model.save_pretrained(ckpt, max_shard_size="20KB")
    before = {p.name: _digest(p) for p in ckpt.iterdir()}
    assert sum(p.suffix == ".safetensors" for p in ckpt.iterdir()) > 2
    ids = torch.randint(0, 100, (2, 16))
    with nanhunt.watch(model, opt, on_find="record"):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # the last layer's weights go bad (the last shard's)
            model.transformer.ln_f.weight[3] = float("inf")
        with pytest.raises(nanhunt.NonFiniteError) as ei:
            model.save_pretrained(ckpt, max_shard_size="20KB")
        fresh = tmp_path / "fresh"
        with pytest.raises(nanhunt.NonFiniteError):
            model.save_pretrained(fresh)
    assert ei.value.finding.tensor == "['transformer.ln_f.weight']"
    assert {p.name: _digest(p) for p in ckpt.iterdir()} == before  # config and every shard as they were
    assert not fresh.exists()  # not even a config.json without weights


def test_safetensors_part_of_a_poisoned_state_is_refused_a_clean_copy_of_it_is_not(tmp_path: Any) -> None:
    """A file holding part of the watched state (one shard, one model's file) is judged against all
    of it; a clean copy of the model under the same names (an EMA model) is another model's."""
    st = pytest.importorskip("safetensors.torch")
    model = zoo.bnmlp()
    ema = copy.deepcopy(model)
    with nanhunt.watch(model, on_find="record"):
        with torch.no_grad():
            model.fc2.weight[0, 0] = float("nan")
        st.save_file(ema.state_dict(), str(tmp_path / "ema.safetensors"))
        part = {k: v for k, v in model.state_dict().items() if k.startswith("fc1.")}
        with pytest.raises(nanhunt.NonFiniteError) as ei:
            st.save_file(part, str(tmp_path / "part.safetensors"))
    assert (tmp_path / "ema.safetensors").exists() and not (tmp_path / "part.safetensors").exists()
    assert ei.value.finding.tensor == "['fc2.weight']" and "part of" in ei.value.finding.hint


@pytest.mark.parametrize("surgery", ["double", "bfloat16", "fresh batchnorm"])
def test_running_statistics_poisoned_after_model_surgery_are_refused(surgery: str, tmp_path: Any) -> None:
    """The guard judged a buffer only when its storage was one the model had at the first step (a
    buffer the model's code puts in place later may be an intended -inf mask): model.double(),
    .to(torch.bfloat16) (or .to(device)) and a BatchNorm swapped for a fresh one give the same
    buffers new storages, so a checkpoint with NaN running statistics was written. Same name,
    same shape: the same state, judged."""
    model = zoo.bnmlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = tmp_path / "ck.pt"
    with nanhunt.watch(model, opt, on_find="record"):
        model(torch.randn(8, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
        dtype = {"double": torch.float64, "bfloat16": torch.bfloat16}.get(surgery, torch.float32)
        if surgery == "fresh batchnorm":
            model.bn = torch.nn.BatchNorm1d(16)
        else:
            model.to(dtype)
        x = torch.randn(8, 6, dtype=dtype)
        x[1, 0] = float("nan")  # a corrupt record in a no-grad pass: the running statistics take it
        with torch.no_grad():
            model(x)
        assert not torch.isfinite(model.bn.running_mean).all()
        with pytest.raises(nanhunt.NonFiniteError, match="bn.running_mean"):
            torch.save(model.state_dict(), path)
    assert not path.exists()


class _FixedMask(torch.nn.Module):
    """A causal mask kept as a finite placeholder of its final shape, then put in place on first use."""

    def __init__(self, t: int = 4, d: int = 8) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.register_buffer("mask", torch.zeros(t, t))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.isinf(self.mask).any():
            self.mask = torch.full_like(self.mask, float("-inf")).triu(1)
        return ((self.lin(x) @ x.transpose(-1, -2)) + self.mask).softmax(-1) @ x


def test_a_mask_put_in_place_at_the_placeholders_shape_is_still_not_judged(tmp_path: Any) -> None:
    """(The surgery test's rule is narrow: same name and shape alone is not the same state.)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_FixedMask(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanhunt.watch(model, opt) as hunt:
        for _ in range(2):
            model(torch.randn(2, 4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        torch.save(model.state_dict(), tmp_path / "ckpt.pt")
    assert hunt.findings == [] and (tmp_path / "ckpt.pt").exists()
