"""nanhunt in the user's profiler traces and logs: `nanhunt::sync/replay/finding` ranges, the
"nanhunt" logger, and library code that never prints."""

from __future__ import annotations

import ast
import logging
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import nanhunt
from nanhunt import _profile


def layernorm_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1))


def train(model: nn.Module, hunt: nanhunt.Hunt, opt: torch.optim.Optimizer, steps: int, bad_step: int) -> None:
    for step in range(steps):
        x = torch.randn(3, 4) * (1e25 if step == bad_step else 1.0)  # LayerNorm's variance overflows float32
        loss = model(x).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_profiler_trace_has_sync_replay_and_finding_ranges():
    model = layernorm_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with pytest.raises(nanhunt.NonFiniteError) as raised:
            with nanhunt.watch(model, opt) as hunt:
                train(model, hunt, opt, steps=5, bad_step=2)
    f = raised.value.finding
    assert f.module == "1" and f.step == 2
    ours = sorted((e for e in prof.events() if e.name.startswith("nanhunt::")), key=lambda e: e.time_range.start)
    names = [e.name for e in ours]
    assert names.count("nanhunt::finding") == 1 and names.count("nanhunt::replay") == 1, names
    at = names.index("nanhunt::finding")
    assert names[:at] == ["nanhunt::sync"] * 3 + ["nanhunt::replay"]  # made at the end of step 2 (0-based)
    replay = ours[at - 1]
    inner = [e for e in prof.events() if e.name == "aten::native_layer_norm"
             and replay.time_range.start <= e.time_range.start <= replay.time_range.end]
    assert inner, "the replay's own ops are inside its range"


def test_nanhunt_replay_of_a_bundle_is_a_replay_range(tmp_path):
    model = layernorm_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    bundle = tmp_path / "first.pt"
    with nanhunt.watch(model, opt, on_find="record", bundle=bundle) as hunt:
        train(model, hunt, opt, steps=3, bad_step=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = nanhunt.replay(bundle)
    assert result.reproduced
    assert [e.name for e in prof.events() if e.name.startswith("nanhunt::")] == ["nanhunt::replay"]


def test_no_profiler_no_record_function(monkeypatch):
    """With no profiler recording, the hot path never builds a record_function (~20 us each)."""
    made = []
    real = torch.profiler.record_function

    def counting(name: str, *a, **k):
        made.append(name)
        return real(name, *a, **k)

    monkeypatch.setattr(torch.profiler, "record_function", counting)
    model = layernorm_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        train(model, hunt, opt, steps=3, bad_step=1)
    assert hunt.first is not None and made == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert _profile.profiling()
        with _profile.span("nanhunt::sync"):
            pass
    assert made == ["nanhunt::sync"]
    assert not _profile.profiling()


def test_idle_span_costs_well_under_a_microsecond():
    span = _profile.span
    n = 20_000
    t0 = time.perf_counter()
    for _ in range(n):
        with span("nanhunt::sync"):
            pass
    per_call = (time.perf_counter() - t0) / n
    assert per_call < 5e-6, f"{per_call * 1e6:.2f} us per idle range"


def test_nvtx_range_on_cuda_when_no_profiler_records(monkeypatch):
    calls: list[tuple[str, str | None]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop", None)))
    with _profile.span("nanhunt::finding", cuda=True):
        calls.append(("body", None))
    assert calls == [("push", "nanhunt::finding"), ("body", None), ("pop", None)]
    calls.clear()
    with _profile.span("nanhunt::sync", cuda=False):  # a CPU run never touches NVTX
        pass
    assert calls == []


# ---------------------------------------------------------------- logging
def test_warn_mode_logs_a_warning_and_warns(caplog):
    model = layernorm_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    caplog.set_level(logging.DEBUG, logger="nanhunt")
    with pytest.warns(nanhunt.NonFiniteWarning) as warned:
        with nanhunt.watch(model, opt, on_find="warn") as hunt:
            train(model, hunt, opt, steps=3, bad_step=1)
    assert hunt.first is not None
    ours = [r for r in caplog.records if r.name == "nanhunt"]
    warnings_logged = [r for r in ours if r.levelno == logging.WARNING]
    # one warning per step, on the logger too; the first is the first finding's summary
    assert [r.getMessage() for r in warnings_logged] == [str(w.message) for w in warned]
    assert str(warned[0].message).startswith(hunt.first.summary())
    infos = [r.getMessage() for r in ours if r.levelno == logging.INFO]
    assert len(infos) == len(hunt.findings) - len(warned)  # the rest at INFO
    assert infos and not any(m.startswith("First") for m in infos)  # only the hunt's first is "First"
    assert any(r.levelno == logging.DEBUG and "watching Sequential" in r.getMessage() for r in ours)


def test_record_mode_logs_info_only(caplog):
    model = layernorm_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    caplog.set_level(logging.INFO, logger="nanhunt")
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        train(model, hunt, opt, steps=3, bad_step=1)
    levels = {r.levelno for r in caplog.records if r.name == "nanhunt"}
    assert levels == {logging.INFO}
    assert caplog.records[0].getMessage() == hunt.first.summary()
    later = [r.getMessage() for r in caplog.records[1:] if r.name == "nanhunt"]
    assert later and not any(m.startswith("First") for m in later)  # each later one headed by its kind


def test_library_is_silent_by_default(capfd):
    """No handler configured: the NullHandler keeps Python's last-resort handler from printing."""
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("nanhunt").handlers)
    model = layernorm_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanhunt.watch(model, opt, on_find="record") as hunt:
        train(model, hunt, opt, steps=3, bad_step=1)
    assert hunt.first is not None
    out, err = capfd.readouterr()
    assert out == "" and err == ""


_ALLOWED = {("_report/render.py", "print_report")}  # renders to the stream the CLI hands it


def test_library_code_never_prints():
    """Only the command line (nanhunt/_cli/) writes to stdout/stderr."""
    pkg = Path(nanhunt.__file__).parent
    bad = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg).as_posix()
        if rel.startswith("_cli/") or rel == "__main__.py":
            continue
        tree = ast.parse(path.read_text())
        allowed = [range(f.lineno, (f.end_lineno or f.lineno) + 1) for f in ast.walk(tree)
                   if isinstance(f, ast.FunctionDef) and (rel, f.name) in _ALLOWED]
        for node in ast.walk(tree):
            printing = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
            stream = (isinstance(node, ast.Attribute) and node.attr in ("stdout", "stderr")
                      and isinstance(node.value, ast.Name) and node.value.id == "sys")
            if (printing or stream) and not any(node.lineno in r for r in allowed):
                bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)[:60]}")
    assert not bad, "library code writes to the terminal:\n" + "\n".join(bad)
