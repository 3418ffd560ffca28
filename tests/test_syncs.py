"""The always-on promise, checked on CPU: at most one host sync added per step, O(1) registration.

Host syncs are counted by proxy: every call of the Tensor methods that read a value back to the
host (`item`, `bool`, `tolist`, `float`, `int`). Plain training is counted the same way (AdamW
itself reads its step counters), and only the difference is nanhunt's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanhunt

READS = ("item", "__bool__", "tolist", "__float__", "__int__")
_MISSING = object()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextmanager
def counting_reads() -> Iterator[list[int]]:
    """Count host reads while the block runs; yields a one-element list holding the count."""
    count = [0]
    saved = {m: torch.Tensor.__dict__.get(m, _MISSING) for m in READS}

    def counted(fn: Any) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            return fn(self, *args, **kwargs)

        return read

    for m in READS:
        setattr(torch.Tensor, m, counted(getattr(torch.Tensor, m)))
    try:
        yield count
    finally:
        for m, fn in saved.items():
            if fn is _MISSING:
                delattr(torch.Tensor, m)
            else:
                setattr(torch.Tensor, m, fn)


class Encoder(nn.Module):
    """A small real model: embedding, two transformer encoder layers, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)))


@contextmanager
def _not_counting_the_cpu_update_check(count: list[int]) -> Iterator[None]:
    """On CPU, the optimizer's update is judged right after ``step()`` (`Hunt._judged_now`): a read
    of a CPU tensor, with no device to wait for. On a GPU that probe is read at the next step's
    sync instead (never a second sync), so this proxy for device syncs leaves it out."""
    from nanhunt._record.hunt import Hunt

    orig = Hunt._judged_now

    def judged(self: Hunt, vec: Any, i: int) -> bool:
        before = count[0]
        try:
            return orig(self, vec, i)
        finally:
            if count[0] > before:
                count[0] -= 1  # its one read of the summary is not counted

    Hunt._judged_now = judged  # type: ignore[method-assign]
    try:
        yield
    finally:
        Hunt._judged_now = orig  # type: ignore[method-assign]


def _reads_per_step(mode: str | None, steps: int, micro: int = 1, pseudo: bool = False) -> tuple[list[int], int]:
    """Host reads of each training step (and of close()), plain when ``mode`` is None; ``micro``
    forward/backward passes per step (gradient accumulation); ``pseudo``: a no_grad pass of the
    same model first in each step (FixMatch's pseudo-labels)."""
    torch.manual_seed(0)
    model = Encoder().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 50, (4, 12))
    hunt = nanhunt.watch(model, optimizer=opt, mode=mode) if mode else None
    per_step = []
    try:
        for _ in range(steps):
            with counting_reads() as n, _not_counting_the_cpu_update_check(n):
                if pseudo:
                    with torch.no_grad():
                        model(ids)
                for _ in range(micro):
                    logits = model(ids)
                    loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
                    if hunt is not None:
                        hunt.check(loss, "loss")
                    (loss / micro).backward()
                opt.step()
                opt.zero_grad()
            per_step.append(n[0])
    finally:
        with counting_reads() as at_close:
            if hunt is not None:
                hunt.close()
    if hunt is not None:
        assert hunt.findings == []
    return per_step, at_close[0]


@pytest.mark.parametrize("mode, micro, pseudo", [("full", 1, False), ("sentinel", 1, False), ("full", 3, False),
                                                 ("sentinel", 1, True)])
def test_at_most_one_host_read_added_per_step(mode: str, micro: int, pseudo: bool) -> None:
    # micro=3: gradient accumulation keeps its gradients between micro-batches: the root's next
    # call does not end the step's check (only an iteration whose gradients are gone again does);
    # pseudo: a no_grad pass in train mode is part of the step, not an evaluation loop
    steps = 12 if micro == 1 and not pseudo else 4  # past one history sample (every 10 steps by default)
    plain, _ = _reads_per_step(None, steps, micro, pseudo)
    watched, at_close = _reads_per_step(mode, steps, micro, pseudo)
    added = [w - p for w, p in zip(watched, plain)]
    assert all(a <= 1 for a in added), f"host reads added per step: {added} (plain: {plain})"
    assert at_close <= 1, f"close() read {at_close} values back"


def test_counting_sees_bool_tolist_and_item() -> None:
    t = torch.tensor([1.0, 2.0])
    before = {m: torch.Tensor.__dict__.get(m, _MISSING) for m in READS}
    with counting_reads() as n:
        bool(t[0])
        t.tolist()
        t[1].item()
        float(t[0])
        if t.all():
            pass
    assert n[0] == 5
    assert {m: torch.Tensor.__dict__.get(m, _MISSING) for m in READS} == before  # restored


_WALKS = ("modules", "named_modules", "children", "named_children", "apply", "parameters",
          "named_parameters", "buffers", "named_buffers")


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_watch_and_close_do_not_walk_the_model(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Registration is O(1): neither watch() nor close() (without a forward) visits the modules,
    and no per-module hook is added."""
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(1000)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[str] = []
    for name in _WALKS:
        orig = getattr(nn.Module, name)

        def walk(self: nn.Module, *args: Any, _orig: Any = orig, _name: str = name, **kwargs: Any) -> Any:
            calls.append(_name)
            return _orig(self, *args, **kwargs)

        monkeypatch.setattr(nn.Module, name, walk)
    hunt = nanhunt.watch(model, optimizer=opt, mode=mode)
    try:
        assert calls == [], f"watch() walked the model: {calls}"
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model[1:]._modules.values())
    finally:
        hunt.close()
    assert calls == [], f"close() walked the model: {calls}"


@pytest.mark.timeout(300)
def test_benchmark_quick_smoke() -> None:
    script = os.path.join(ROOT, "benchmarks", "overhead.py")
    out = subprocess.run(
        [sys.executable, script, "--quick", "--models", "mlp", "--rounds", "1"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "## Step time vs plain" in out.stdout
    header = next(line for line in out.stdout.splitlines() if line.startswith("model |"))
    for column in ("plain ms/step", "nanhunt full", "nanhunt sentinel", "naive hook", "detect_anomaly"):
        assert column in header
    assert "## Targets met?" in out.stdout
    assert "mlp   | full" in out.stdout


@pytest.mark.timeout(120)
def test_opcode_counts_attribute_each_module_call() -> None:
    """benchmarks/opcodes.py: the wrapper's bytecodes are counted once per module call of the
    benchmark MLP (24 blocks of 3 under their Sequential, the head, the root: 98 a step), the
    step's own functions once a step, and a function asked for is broken down by line."""
    script = os.path.join(ROOT, "benchmarks", "opcodes.py")
    out = subprocess.run(
        [sys.executable, script, "--variants", "full,sentinel", "--steps", "2", "--top", "40",
         "--lines", "_record/hunt.py:_flush"],
        capture_output=True, text=True, timeout=110, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    full, sentinel = out.stdout.split("## mlp, sentinel")
    rows = {line.split()[-1]: line.split() for line in full.splitlines() if line.strip().endswith(("__call__", "_with_grads"))}
    assert float(rows["_record/forwards.py:__call__"][1]) == 98.0
    assert float(rows["_record/hunt.py:_with_grads"][1]) == 1.0
    assert "hunt.py:" in full.split("line\n", 1)[1]  # _flush's lines
    assert "_record/forwards.py:__call__" not in sentinel  # sentinel wraps nothing inside the model
