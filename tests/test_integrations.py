"""Integrations: Lightning's ``NanHunt`` callback and Hugging Face's ``NanHuntCallback``.

Real trainers on tiny models, real faults: a forward NaN at a given step (Lightning runs forward
and backward inside ``optimizer.step(closure)``), a NaN loss made outside any module, a NaN in
validation, and an exploding learning rate under the HF ``Trainer`` (accelerate wraps the optimizer).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules import module as _module_mod

import nanhunt
from tests import zoo

# Lightning / transformers / accelerate chatter that is not about nanhunt
_THIRD_PARTY = [
    "ignore::UserWarning:lightning.*",
    "ignore::UserWarning:pytorch_lightning.*",
    "ignore::UserWarning:lightning_fabric.*",
    "ignore::UserWarning:accelerate.*",
    "ignore::UserWarning:transformers.*",
    "ignore:.*does not have many workers.*",
    "ignore:.*LeafSpec.*",
]


def _mark(f: Any) -> Any:
    for w in _THIRD_PARTY:
        f = pytest.mark.filterwarnings(w)(f)
    return f


def _ours() -> list[Any]:
    """Global forward hooks that belong to a nanhunt Hunt."""
    out = []
    for d in (_module_mod._global_forward_hooks, _module_mod._global_forward_pre_hooks):
        for h in d.values():
            owner = getattr(h, "__self__", None)
            if isinstance(owner, nanhunt.Hunt):
                out.append(h)
    return out


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# ====================================================================== Lightning
def _lightning() -> Any:
    return pytest.importorskip("lightning.pytorch")


def _lightning_parts() -> tuple[Any, Any]:
    pl = _lightning()
    from nanhunt.integrations.lightning import NanHunt

    class LogAbs(nn.Module):
        """log(|x| * scale): a zero scale makes log(0) = -inf, born here from finite inputs."""

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.ones(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(x.abs() * self.scale + 1e-3 * (self.scale > 0))

    class Net(pl.LightningModule):
        def __init__(self, bad_forward_at: int = -1, bad_loss_at: int = -1, bad_val: bool = False) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), LogAbs(), nn.Linear(8, 1))
            self.bad_forward_at = bad_forward_at
            self.bad_loss_at = bad_loss_at
            self.bad_val = bad_val
            self.snaps: dict[int, dict[str, torch.Tensor]] = {}

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            self.snaps[self.global_step] = _snapshot(self)
            if self.global_step == self.bad_forward_at:
                self.net[2].scale.zero_()
            x, y = batch
            pred = self.net(x)
            if self.global_step == self.bad_loss_at:
                return torch.log((pred - pred).abs().mean())  # log(0) in training_step, outside any module
            return ((pred - y) ** 2).mean()

        def validation_step(self, batch: Any, i: int) -> None:
            if self.bad_val and not self.trainer.sanity_checking and i == 1:
                self.net[2].scale.zero_()
            x, _ = batch
            self.net(x)
            self.net[2].scale.fill_(1.0)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return pl, (Net, NanHunt)


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=4)


def _trainer(pl: Any, cb: Any, **kw: Any) -> Any:
    opts: dict[str, Any] = dict(max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    opts.update(kw)
    return pl.Trainer(callbacks=[cb], **opts)


@_mark
def test_lightning_forward_nan_is_reported_at_its_step_before_the_update() -> None:
    pl, (Net, NanHunt) = _lightning_parts()
    model, cb = Net(bad_forward_at=3), NanHunt()
    hooks_before = len(_module_mod._global_forward_hooks)
    trainer = _trainer(pl, cb)
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        trainer.fit(model, _loader())
    f = ei.value.finding
    assert (f.phase, f.module, f.module_type, f.tensor) == ("forward", "net.2", "LogAbs", "output")
    assert f.step == 3 == trainer.global_step  # forward+backward ran inside step(closure): still step 3
    assert f.cause == "created" and f.op == "aten.log.default"
    # the optimizer never applied step 3: the weights are those step 3 started from
    now = _snapshot(model)
    assert all(torch.equal(now[k], v) for k, v in model.snaps[3].items() if k != "net.2.scale")
    assert not all(torch.equal(now[k], v) for k, v in model.snaps[0].items())  # steps 0..2 did train
    assert cb.report is not None and cb.report.first == f and cb.hunt.first == f
    assert cb.hunt.closed and not _ours() and len(_module_mod._global_forward_hooks) == hooks_before
    cb.close()  # idempotent


@_mark
def test_lightning_a_nan_row_of_the_fit_loader_is_named_by_its_dataset_index() -> None:
    pl, (Net, NanHunt) = _lightning_parts()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)
    x[45, 2] = float("nan")  # a corrupt row of the data set; the model is fine
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True,
                                         generator=torch.Generator().manual_seed(1))
    model, cb = Net(), NanHunt()  # no loader= given: the callback takes the one fit() was given
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        _trainer(pl, cb, max_steps=16).fit(model, loader)
    f = ei.value.finding
    assert (f.phase, f.module, f.cause, f.samples) == ("forward", "net.0", "input", (45,))
    assert cb.report.bad_samples == [45] and f.step < 8
    assert type(loader.batch_sampler) is torch.utils.data.BatchSampler and "_get_iterator" not in vars(loader)


@_mark
@pytest.mark.parametrize(("mode", "watched"), [("full", "model"), ("sentinel", "model"), ("full", "wrapper")])
def test_lightning_forward_redirection_is_no_call_of_the_model(mode: str, watched: str) -> None:
    # Lightning's DDP/FSDP/DeepSpeed strategies (and Fabric) run training_step through the model's
    # forward: the instance's forward is set to a `wrapped_forward` for one call, which runs the
    # step, whose self(x) is the real call. The hunt took that outer call as the model's top-level
    # call, its replay ran the real forward with (batch, batch_idx) (a TypeError), and every DDP
    # finding said "origin unknown", with no element, op or cause
    _lightning()
    from lightning.pytorch.strategies.strategy import _ForwardRedirection

    class Wrapper(nn.Module):  # what DistributedDataParallel does with the model it wraps
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, *args: Any) -> Any:
            return self.module(*args)

    class Step(_lightning().LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = zoo.lognet()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: torch.Tensor, i: int) -> torch.Tensor:
            return self(batch).pow(2).mean()

    model = Step()
    redirect, wrapper = _ForwardRedirection(), Wrapper(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    xs = [torch.rand(3, 4, generator=g) for _ in range(3)]
    with torch.no_grad():
        model.net.lin.bias.fill_(10.0)  # lin's outputs positive: log is finite
    before = None
    # (watching the wrapper, as Fabric's setup() hands it back: the call it makes of the model is no call either)
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model if watched == "model" else wrapper, opt,
                                                                    mode=mode):
        for i, x in enumerate(xs):
            if i == 2:
                with torch.no_grad():
                    model.net.lin.bias[1] = -1e3  # ReLU's zeros at that column: log(0) = -inf
                before = _snapshot(model)
            redirect(wrapper, model, "training_step", x, i).backward()
            opt.step()
            opt.zero_grad()
    f = ei.value.finding
    name = "net.log" if watched == "model" else "module.net.log"
    assert (f.phase, f.module, f.module_type, f.step, f.cause) == ("forward", name, "Log", 2, "created"), f
    assert (f.op, f.index, f.value) == ("aten.log.default", (0, 1), float("-inf")), f
    assert all(torch.equal(v, before[k]) for k, v in _snapshot(model).items())  # step 2 never applied


@_mark
def test_lightning_nan_loss_made_outside_modules_is_found_where_it_is_born() -> None:
    pl, (Net, NanHunt) = _lightning_parts()
    model, cb = Net(bad_loss_at=2), NanHunt()
    trainer = _trainer(pl, cb)
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        trainer.fit(model, _loader())
    f = ei.value.finding
    # training_step's own code (outside every module call): the op and line, not just the loss
    assert (f.phase, f.module, f.step, f.op) in (("forward", "<outside>", 2, "aten.log.default"),
                                                 ("check", "loss", 2, "aten.log.default"))
    with open(__file__) as fh:
        want = next(i + 1 for i, s in enumerate(fh) if "log(0) in training_step" in s)
    assert f.source is not None and f.source.endswith(f"test_integrations.py:{want}")
    now = _snapshot(model)
    assert all(torch.equal(now[k], v) for k, v in model.snaps[2].items())
    assert cb.hunt.closed and not _ours()


@_mark
def test_lightning_clean_fit_counts_optimizer_steps_with_accumulation() -> None:
    pl, (Net, NanHunt) = _lightning_parts()
    model, cb = Net(), NanHunt(on_find="raise", history=4)
    trainer = _trainer(pl, cb, max_steps=4, accumulate_grad_batches=2)
    trainer.fit(model, _loader())
    assert trainer.global_step == 4
    assert cb.hunt.closed and cb.hunt.step == 4 and cb.hunt.findings == []
    assert cb.report is not None and cb.report.first is None  # readable after close
    assert not _ours()


@_mark
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_lightning_a_lookaheads_pull_back_is_part_of_the_optimizer_step(mode: str) -> None:
    # configure_optimizers returns a Lookahead over SGD: its step() steps the SGD, then every 2nd
    # step pulls the weights in place towards slow copies. The callback unwrapped it and watched the
    # SGD, whose post-step hook noted the weights' versions before the pull-back moved them: an lr
    # overflow at step 3 read at the next step (sentinel) was "forward, step 4, cause 'parameter':
    # written after its optimizer's last step (a load_state_dict, an in-place assignment in your code)"
    pl, (Net, NanHunt) = _lightning_parts()

    class LookaheadNet(Net):
        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            self.trainer.optimizers[0].param_groups[0]["lr"] = 1e38 if self.global_step == 3 else 0.05
            return super().training_step(batch, i) * 100

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return zoo.Lookahead(torch.optim.SGD(self.parameters(), lr=0.05))

    model, cb = LookaheadNet(), NanHunt(mode=mode)
    trainer = _trainer(pl, cb)
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        trainer.fit(model, _loader())
    f = ei.value.finding
    assert (f.phase, f.step, f.cause) == ("optimizer", 3, "created"), f
    assert "its lr is 1e+38" in f.hint and "written after" not in f.hint, f.hint
    assert cb.hunt.closed and not _ours() and "step" not in vars(trainer.optimizers[0])


@_mark
def test_lightning_validation_nan_during_fit() -> None:
    pl, (Net, NanHunt) = _lightning_parts()
    model, cb = Net(bad_val=True), NanHunt()
    trainer = _trainer(pl, cb, max_steps=6, val_check_interval=2, limit_val_batches=3)
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        trainer.fit(model, _loader(), _loader())
    f = ei.value.finding
    assert (f.phase, f.module, f.step) == ("forward", "net.2", 2)  # after 2 training steps, first validation
    assert trainer.global_step == 2
    assert cb.hunt.closed and not _ours()


@_mark
@pytest.mark.parametrize("inference_mode", [False, True])
def test_lightning_validate_alone_and_record_mode(tmp_path: Any, inference_mode: bool) -> None:
    pl, (Net, NanHunt) = _lightning_parts()
    model, cb = Net(bad_val=True), NanHunt(on_find="record", report=tmp_path / "r.json")
    trainer = _trainer(pl, cb, limit_val_batches=3, inference_mode=inference_mode)
    trainer.validate(model, _loader(), verbose=False)
    assert cb.hunt.closed and not _ours()
    f = cb.report.first
    assert f is not None and (f.phase, f.module, f.step) == ("forward", "net.2", 1)  # batch 1
    assert nanhunt.Report.load(tmp_path / "r.json").first == f


@_mark
def test_lightning_options_are_checked_up_front() -> None:
    _lightning()
    from nanhunt.integrations.lightning import NanHunt

    with pytest.raises(TypeError, match="optimizer"):
        NanHunt(optimizer=None)
    with pytest.raises(ValueError, match="on_find"):
        NanHunt(on_find="explode")
    with pytest.raises(TypeError, match=r"^NanHunt\(\) got an unexpected keyword argument 'on_fnd'.*on_find"):
        NanHunt(on_fnd="warn")  # a typo is named with the class the user called, not Options.make
    assert NanHunt().report is None


# ====================================================================== Hugging Face
@_mark
def test_lightning_resumed_fit_numbers_findings_as_global_step(tmp_path: Any) -> None:
    """``fit(ckpt_path=...)``: the trainer's global_step goes on from the checkpoint's, and so does
    the hunt's step (it started at 0: a finding at global step 4 said "step 2")."""
    pl, (Net, NanHunt) = _lightning_parts()
    first = _trainer(pl, NanHunt(), max_steps=2, enable_checkpointing=True, default_root_dir=str(tmp_path))
    first.fit(Net(), _loader())
    ckpt = tmp_path / "two.ckpt"
    first.save_checkpoint(str(ckpt))
    model, cb = Net(bad_forward_at=4), NanHunt()
    trainer = _trainer(pl, cb, max_steps=8)
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        trainer.fit(model, _loader(), ckpt_path=str(ckpt))
    f = ei.value.finding
    assert (f.phase, f.module, f.step) == ("forward", "net.2", 4)
    assert f.step == trainer.global_step


def _hf_parts(tmp_path: Any, lr: float, *, optimizers: Any = None, watch_options: dict[str, Any] | None = None,
              **kw: Any) -> tuple[Any, Any, Any]:
    """``optimizers``: a function of the model giving the Trainer's ``optimizers=`` (else its own SGD)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # the Trainer needs it
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from nanhunt.integrations.transformers import NanHuntCallback

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)

    class Tokens(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.x = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.x[i], "labels": self.x[i]}

    opts: dict[str, Any] = dict(output_dir=str(tmp_path), max_steps=5, per_device_train_batch_size=2, report_to=[],
                                use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True,
                                learning_rate=lr, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0)
    opts.update(kw)
    cb = NanHuntCallback(**(watch_options or {}))
    more = {"optimizers": optimizers(model)} if optimizers is not None else {}
    trainer = Trainer(model=model, args=TrainingArguments(**opts), train_dataset=Tokens(), callbacks=[cb], **more)
    return trainer, model, cb


@_mark
def test_hf_a_nan_row_of_the_train_dataset_is_named_by_its_dataset_index(tmp_path: Any) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    from nanhunt.integrations.transformers import NanHuntCallback

    class Rows(torch.utils.data.Dataset):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(0)
            self.x, self.y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)
            self.x[21, 1] = float("nan")  # a corrupt row of the data set; the model is fine

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": self.x[i], "labels": self.y[i]}

    class Regression(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": nn.functional.mse_loss(self.net(x), labels)}

    torch.manual_seed(0)
    cb = NanHuntCallback()  # no loader= given: the callback takes the Trainer's (shuffled) train loader
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, num_train_epochs=1, report_to=[],
                             use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=Regression(), args=args, train_dataset=Rows(), callbacks=[cb])
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        trainer.train()
    f = ei.value.finding
    assert (f.phase, f.module, f.cause, f.samples) == ("forward", "net.0", "input", (21,))
    assert cb.report.bad_samples == [21]


@_mark
def test_hf_exploding_learning_rate_is_found_and_nothing_left_behind(tmp_path: Any) -> None:
    from transformers import TrainerCallback

    trainer, model, cb = _hf_parts(tmp_path, lr=1e30)
    snaps: dict[int, dict[str, torch.Tensor]] = {}

    class Snap(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            snaps[state.global_step] = _snapshot(model)

    trainer.add_callback(Snap())
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        trainer.train()
    f = ei.value.finding
    names = dict(model.named_modules())
    assert f.module in names and type(names[f.module]).__name__ == f.module_type
    # SGD with lr=1e30 makes weights ~1e30 after step 0; step 1's first LayerNorm overflows
    assert (f.phase, f.module, f.module_type, f.step) == ("forward", "transformer.h.0.ln_1", "LayerNorm", 1)
    assert f.cause == "created"
    assert trainer.state.global_step == 1
    now = _snapshot(model)
    assert all(torch.equal(now[k], v) for k, v in snaps[1].items())  # step 1 never applied
    assert cb.report is not None and cb.report.first == f
    assert cb.hunt.closed and not _ours()  # closed itself before raising: the Trainer has no exception hook
    cb.close()  # idempotent


@_mark
def test_hf_a_lookaheads_pull_back_is_part_of_the_optimizer_step(tmp_path: Any) -> None:
    # Trainer(optimizers=(Lookahead(SGD), schedule)): accelerate wraps the Lookahead, whose step()
    # steps the SGD, then every 2nd step pulls the weights in place towards slow copies. The callback
    # unwrapped both wrappers and watched the SGD, whose post-step hook noted the weights' versions
    # before the pull-back moved them: an update that overflowed at step 3, read at the next step
    # (sentinel), was "forward, step 4, cause 'parameter': written after its optimizer's last step"
    from transformers import TrainerCallback

    made: list[torch.optim.Optimizer] = []

    def optimizers(model: nn.Module) -> tuple[Any, Any]:
        made.append(torch.optim.SGD(model.parameters(), lr=1e-2))
        return zoo.Lookahead(made[0]), torch.optim.lr_scheduler.LambdaLR(made[0], lambda s: 1.0)

    class Spike(TrainerCallback):  # a weight decay of 1e3 at an lr of 3e38: the update overflows at step 3
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            spike = state.global_step == 3
            made[0].param_groups[0].update(lr=3e38 if spike else 1e-2, weight_decay=1e3 if spike else 0.0)

    trainer, model, cb = _hf_parts(tmp_path, lr=1e-2, max_steps=6, optimizers=optimizers,
                                   watch_options={"mode": "sentinel"})
    trainer.add_callback(Spike())
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        trainer.train()
    f = ei.value.finding
    assert (f.phase, f.step, f.cause) == ("optimizer", 3, "created"), f
    assert "written after" not in f.hint, f.hint
    assert cb.hunt.closed and not _ours() and "step" not in vars(trainer.optimizer)


@_mark
def test_hf_clean_run_steps_the_real_optimizer(tmp_path: Any) -> None:
    trainer, model, cb = _hf_parts(tmp_path, lr=1e-3, max_steps=3, gradient_accumulation_steps=2)
    trainer.train()
    # accelerate wraps the optimizer; the hooks sit on the torch optimizer that really steps
    assert type(trainer.optimizer).__name__ == "AcceleratedOptimizer"
    assert cb.hunt.closed and cb.hunt.step == 3 == trainer.state.global_step
    assert cb.report is not None and cb.report.first is None
    assert not _ours()


@_mark
def test_hf_accumulated_micro_batch_without_labels_is_named_and_the_trainer_freed(tmp_path: Any) -> None:
    """gradient_accumulation_steps=4, a loss that averages over the labelled tokens, and one
    micro-batch whose labels are all -100: 0/0 in compute_loss, at optimizer step 2, micro-batch 2.
    After the error, the callback kept for its report kept the Trainer and the model alive (the
    closed hunt held the raised error, whose traceback held train()'s frames)."""
    import gc
    import weakref

    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from nanhunt.integrations.transformers import NanHuntCallback

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 32, (48, 6), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[(2 * 4 + 2) * 2:(2 * 4 + 2) * 2 + 2] = -100  # batch size 2: step 2, micro-batch 2

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": ids[i], "labels": labels[i]}

    class Masked(Trainer):
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kw: Any) -> torch.Tensor:
            y = inputs.pop("labels").flatten()
            ce = nn.functional.cross_entropy(model(**inputs).logits.flatten(0, 1), y, reduction="none")
            mask = (y != -100).float()
            return (ce * mask).sum() / mask.sum()  # 0/0 for a micro-batch with no label

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True,
                             gradient_accumulation_steps=4, learning_rate=1e-3)
    cb = NanHuntCallback()
    trainer = Masked(model=model, args=args, train_dataset=Rows(), callbacks=[cb])
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(Rows())  # type: ignore[method-assign]
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        trainer.train()
    f = ei.value.finding
    assert (f.phase, f.module, f.step, f.call, f.op) == ("forward", "<outside>", 2, 2, "aten.div.Tensor"), f
    assert f.step == trainer.state.global_step and f.source is not None and "test_integrations.py" in f.source
    assert all(torch.isfinite(p).all() for p in model.parameters())
    ref = weakref.ref(model)
    del trainer, model, ei
    gc.collect()
    assert cb.hunt.closed and not _ours() and cb.report.first == f
    assert ref() is None, "the callback's closed hunt kept the model alive"


@_mark
def test_hf_label_smoothing_over_a_batch_without_labels_names_the_ignored_labels(tmp_path: Any) -> None:
    """label_smoothing_factor: the Trainer's LabelSmoother fills the ignored positions with 0, sums, and
    divides by num_items_in_batch, a float count under the Trainer. A batch whose labels are all -100 is
    0/0 there; the hint was the generic "a zero vector divided by its norm, an IoU of zero-area boxes ..."
    instead of the count of 0 and the -100 labels that the Trainer's own loss (no smoothing) gets."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from nanhunt.integrations.transformers import NanHuntCallback

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8, bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 32, (8, 6), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[2:4] = -100  # batch size 2: the batch of step 1 has no label

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": ids[i], "labels": labels[i]}

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True,
                             label_smoothing_factor=0.1)
    cb = NanHuntCallback()
    trainer = Trainer(model=GPT2LMHeadModel(cfg), args=args, train_dataset=Rows(), callbacks=[cb])
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(Rows())  # type: ignore[method-assign]
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        trainer.train()
    f = ei.value.finding
    assert (f.phase, f.module, f.step, f.op) == ("forward", "<outside>", 1, "aten.div.Tensor"), f
    assert f.source is not None and "trainer_pt_utils.py" in f.source
    assert "every label of the batch is ignored (-100)" in f.hint, f.hint
    assert cb.hunt.closed and not _ours()


def test_hf_options_are_checked_up_front() -> None:
    pytest.importorskip("transformers")
    from nanhunt.integrations.transformers import NanHuntCallback

    with pytest.raises(TypeError, match="model"):
        NanHuntCallback(model=None)
    with pytest.raises(ValueError, match="on_find"):
        NanHuntCallback(on_find=1)
    with pytest.raises(TypeError, match=r"^NanHuntCallback\(\) got an unexpected keyword argument 'on_fnd'"):
        NanHuntCallback(on_fnd="warn")
    assert NanHuntCallback().report is None


# ====================================================================== missing frameworks
@pytest.mark.parametrize(
    "module, blocked, extra",
    [
        ("nanhunt.integrations.lightning", ("lightning", "lightning.pytorch", "pytorch_lightning"), "lightning"),
        ("nanhunt.integrations.transformers", ("transformers",), "transformers"),
    ],
)
def test_missing_framework_says_how_to_install(monkeypatch: Any, module: str, blocked: tuple[str, ...],
                                               extra: str) -> None:
    for name in blocked:
        monkeypatch.setitem(sys.modules, name, None)
    if module in sys.modules:
        monkeypatch.delitem(sys.modules, module)
    with pytest.raises(ImportError, match=rf"pip install 'nanhunt\[{extra}\]'"):
        importlib.import_module(module)
