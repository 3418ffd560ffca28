"""Reports that show the answer: the heatmap row and cell of the finding, the source line's text
in every format, TensorBoard export, and files written with normal permissions."""

from __future__ import annotations

import dataclasses
import io
import json
import linecache
import os
import re
import sys
import textwrap

import pytest
import torch

import nanhunt
from nanhunt import Report
from nanhunt._report.heatmap import heatmap_svg, tree_order
from nanhunt._report.render import html, text

from . import zoo


def _row_label(svg: str) -> str:
    """The heatmap's highlighted row label (the finding's module)."""
    m = re.search(r'font-weight="bold"><title>([^<]*)</title>', svg)
    assert m is not None, "no highlighted row"
    return m.group(1)


def _marked_cell_title(svg: str) -> str:
    m = re.search(r'<rect class="finding" x="([\d.]+)" y="([\d.]+)"', svg)
    assert m is not None, "no finding outline"
    x, y = float(m.group(1)) + 2, float(m.group(2)) + 2
    cell = re.search(rf'<rect x="{x:g}" y="{y:g}" width="[\d.]+" height="[\d.]+" fill="([^"]+)"><title>([^<]*)</title>',
                     svg)
    assert cell is not None, "the outline surrounds no cell"
    assert cell.group(1) == "#111111"  # drawn non-finite
    return cell.group(2)


# ---------------------------------------------------------------- heatmap
def test_heatmap_has_the_nested_attention_of_gpt2_with_its_cell_marked():
    """fp16 GPT-2 whose first attention's q·k overflows: the finding names `transformer.h.0.attn`, a
    container whose output is its child's; its row must be in the history and the heatmap."""
    model = zoo.gpt2(dropout=0.0).half()
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight.mul_(3000)  # q·k past float16's 65504
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with nanhunt.watch(model, on_find="record") as hunt, torch.no_grad():
        model(ids)
    f = hunt.first
    assert f is not None and f.module == "transformer.h.0.attn" and f.cause == "created", f
    report = hunt.report
    assert "transformer.h.0.attn" in report.history["modules"]
    svg = heatmap_svg(report.history, (f.module, f.step), f.value)
    assert _row_label(svg) == "transformer.h.0.attn"
    assert _marked_cell_title(svg).startswith(f"transformer.h.0.attn @ step {f.step} · abs-max nan")
    page = report.to_html()
    assert page.count('class="finding"') == 1


def test_heatmap_adds_the_finding_module_and_step_when_never_sampled():
    hist = {"steps": [0, 10, 20], "modules": ["enc", "enc.lin", "head"],
            "absmax": [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [0.5, 0.5, 0.5]]}
    svg = heatmap_svg(hist, ("enc.attn", 25), float("inf"))
    assert _row_label(svg) == "enc.attn"
    assert _marked_cell_title(svg).startswith("enc.attn @ step 25 · abs-max inf · the finding")
    # a finding between two sampled steps gets its own column there
    svg = heatmap_svg(hist, ("head", 15), float("nan"))
    assert _marked_cell_title(svg).startswith("head @ step 15 ")
    labels = [int(s) for s in re.findall(r'text-anchor="middle"[^>]*>(\d+)</text>', svg)]
    assert labels == sorted(labels) and 15 in labels


def test_heatmap_rows_in_model_order_parent_above_children():
    names = ["tok", "blocks.0.attn.qkv", "blocks.0.attn", "blocks.0.mlp.0", "blocks.0.mlp", "blocks.0", "head", ""]
    assert [names[i] for i in tree_order(names)] == [
        "", "tok", "blocks.0", "blocks.0.attn", "blocks.0.attn.qkv", "blocks.0.mlp", "blocks.0.mlp.0", "head"]


def test_heatmap_is_readable_at_a_glance():
    """Cells wide enough to see and labels big enough to read, whatever the number of sampled steps."""
    for n_steps in (3, 10, 64):
        hist = {"steps": list(range(0, 10 * n_steps, 10)), "modules": ["a", "b"],
                "absmax": [[1.0] * n_steps, [2.0] * n_steps]}
        svg = heatmap_svg(hist, ("a", 10 * n_steps - 10), float("nan"))
        width = int(re.search(r'<svg[^>]* width="(\d+)"', svg).group(1))  # type: ignore[union-attr]
        assert width >= 640
        assert 'font-size="12"' in svg and 'font-size="10"' not in svg
        cell_w = float(re.search(r'<rect x="[\d.]+" y="[\d.]+" width="([\d.]+)"', svg).group(1))  # type: ignore[union-attr]
        assert cell_w >= 11
        # nothing drawn past the right edge (the legend's last label included)
        for x, label in re.findall(r'<text x="([\d.]+)" y="[\d.]+"[^>]*>([^<]*)</text>', svg):
            assert float(x) + 7.3 * len(label) <= width, (label, x, width)


# ---------------------------------------------------------------- the source line's text
MODULE = '''
import torch
from torch import nn


class LogHead(nn.Module):
    def forward(self, x):
        return torch.log(x.abs().sum(-1) * 0.0)  # log(0): -inf


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = LogHead()

    def forward(self, x):
        return self.head(self.lin(x)).mean()
'''
LINE = "return torch.log(x.abs().sum(-1) * 0.0)  # log(0): -inf"


@pytest.fixture
def logheadnet(tmp_path, monkeypatch):
    path = tmp_path / "logheadmodel.py"
    path.write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "logheadmodel", raising=False)
    import logheadmodel  # type: ignore[import-not-found]

    torch.manual_seed(0)
    yield logheadmodel.Net(), path
    sys.modules.pop("logheadmodel", None)


def test_source_line_text_in_every_format(logheadnet, tmp_path):
    model, path = logheadnet
    with nanhunt.watch(model, on_find="record") as hunt:
        model(torch.randn(3, 4))
    report = hunt.report
    f = report.first
    assert f is not None and f.source == f"{path}:8" and f.module == "head"
    assert report.sources[f.source] == LINE
    # text
    assert any(re.fullmatch(rf"  line +{re.escape(LINE)}", ln) for ln in text(report).splitlines())
    # rich
    rich_console = pytest.importorskip("rich.console")
    buf = io.StringIO()
    rich_console.Console(file=buf, width=200, color_system=None).print(report)
    assert LINE in buf.getvalue()
    # html (escaped)
    assert "return torch.log(x.abs().sum(-1) * 0.0)  # log(0): -inf" in html(report)
    # json: every finding dict has it, and the map of every line the report names
    d = json.loads(report.to_json())
    assert d["first"]["source_text"] == LINE and d["findings"][0]["source_text"] == LINE
    assert d["sources"][f.source] == LINE
    # a saved report keeps the text when the file is gone
    saved = report.save(tmp_path / "r.json")
    path.unlink()
    linecache.clearcache()
    back = Report.load(saved)
    assert back.sources == report.sources and text(back) == text(report)


def test_road_shows_each_line_once(tmp_path):
    from .test_render import report as golden_report

    r = golden_report()
    r.sources = {"model.py:41": 'scores = scores.masked_fill(mask, float("-inf"))',
                 "model.py:42": "attn = scores.softmax(-1)"}
    lines = text(r).splitlines()
    i = lines.index("    1. aten.masked_fill.Scalar @ model.py:41")
    assert lines[i + 1].strip() == 'scores = scores.masked_fill(mask, float("-inf"))'
    assert lines[i + 2] == "    2. aten._softmax.default @ model.py:42"
    assert lines[i + 3].strip() == "attn = scores.softmax(-1)"
    page = html(r)
    assert "<div class='src'>attn = scores.softmax(-1)</div>" in page


# ---------------------------------------------------------------- TensorBoard
class FakeWriter:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []
        self.texts: list[tuple[str, str, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def add_text(self, tag: str, value: str, step: int) -> None:
        self.texts.append((tag, value, step))


def _report_with_history() -> Report:
    from .test_render import report as golden_report

    return golden_report()


def test_to_tensorboard_writes_history_and_findings():
    r = _report_with_history()
    w = FakeWriter()
    n = r.to_tensorboard(w)
    assert n == len(w.scalars) + len(w.texts)
    attn = [(v, s) for t, v, s in w.scalars if t == "nanhunt/absmax/layers.3.attn"]
    assert attn[:3] == [(10.0, 36), (100.0, 37), (1000.0, 38)]
    assert attn[-1][1] == 41  # the finding's value at its step
    assert ("nanhunt/absmax/<model>", 1.0, 36) in w.scalars
    assert not any(t == "nanhunt/absmax/embed" and s == 39 for t, _, s in w.scalars)  # not measured: not written
    (report_text,) = [x for x in w.texts if x[0] == "nanhunt/report"]
    assert report_text[2] == 41 and "First NaN: forward of `layers.3.attn`" in report_text[1]
    assert [s for t, _, s in w.texts if t == "nanhunt/findings"] == [41, 41]
    with pytest.raises(TypeError, match="SummaryWriter"):
        r.to_tensorboard(object())


def test_to_tensorboard_with_a_real_summary_writer(tmp_path):
    pytest.importorskip("tensorboard", reason="pip install tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    r = _report_with_history()
    with SummaryWriter(str(tmp_path)) as writer:
        r.to_tensorboard(writer)
    ea = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    steps = [(e.step, e.value) for e in ea.Scalars("nanhunt/absmax/layers.3.attn")]
    assert steps[:3] == [(36, 10.0), (37, 100.0), (38, 1000.0)]
    assert "nanhunt/report/text_summary" in ea.Tags()["tensors"]


# ---------------------------------------------------------------- permissions
@pytest.mark.parametrize("suffix", [".json", ".html", ".txt"])
def test_reports_are_written_with_normal_permissions(tmp_path, suffix):
    old = os.umask(0o022)
    try:
        path = _report_with_history().save(tmp_path / f"r{suffix}")
        assert os.stat(path).st_mode & 0o777 == 0o644
        os.chmod(path, 0o640)  # a file that is replaced keeps its own mode
        _report_with_history().save(path)
        assert os.stat(path).st_mode & 0o777 == 0o640
        os.umask(0o077)
        path2 = _report_with_history().save(tmp_path / f"private{suffix}")
        assert os.stat(path2).st_mode & 0o777 == 0o600
    finally:
        os.umask(old)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".nanhunt-")] == []


def test_bundles_are_written_with_normal_permissions(tmp_path, logheadnet):
    model, _ = logheadnet
    old = os.umask(0o022)
    try:
        with nanhunt.watch(model, on_find="record", bundle=tmp_path / "first.pt"):
            model(torch.randn(3, 4))
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "first.pt").st_mode & 0o777 == 0o644


def test_rich_shows_source_lines_verbatim():
    """A line like `x[mask]` is code, not rich markup."""
    rich_console = pytest.importorskip("rich.console")
    from .test_render import report as golden_report

    r = golden_report()
    r.sources = {"model.py:42": "attn = scores[mask].softmax(-1)  # [bold]"}
    buf = io.StringIO()
    rich_console.Console(file=buf, width=200, color_system=None).print(r)
    assert "attn = scores[mask].softmax(-1)  # [bold]" in buf.getvalue()


def test_containers_that_hand_on_a_childs_output_keep_their_history_row():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), torch.nn.Linear(4, 2))
    with nanhunt.watch(model, on_find="record", stats_every=1) as hunt:
        for _ in range(3):
            model(torch.randn(5, 4))
    hist = hunt.report.history
    rows = dict(zip(hist["modules"], hist["absmax"]))
    assert set(rows) == {"", "0", "0.0", "0.1", "1"}
    assert rows["0"] == rows["0.1"]  # the inner Sequential hands on its ReLU's output: the same numbers
    assert rows[""] == rows["1"]
    assert all(len(r) == 3 and None not in r for r in rows.values())


def test_findings_compare_and_hash_by_their_data_even_with_a_nan_value(tmp_path):
    """A finding's value is NaN more often than not, and a frozen dataclass compares NaN != NaN:
    a finding was unequal to itself read back from its report, and it could not be put in a set
    (its dict fields were unhashable), so findings from two runs or two ranks could not be matched."""
    model = zoo.lognet()
    with nanhunt.watch(model, on_find="record") as hunt:
        x = torch.randn(4, 4)
        x[1, 2] = float("nan")  # fed in: the value at the input is NaN
        model(x)
        model(torch.zeros(4, 4))  # log(0): -inf born here
    found = hunt.report.findings
    assert any(f.value is not None and f.value != f.value for f in found), "no NaN-valued finding to compare"
    path = tmp_path / "r.json"
    hunt.report.save(str(path))
    back = Report.load(str(path)).findings
    assert back == found and all(a == b and hash(a) == hash(b) for a, b in zip(back, found))
    assert len({*found, *back}) == len(found) and {f: f.step for f in found}[back[0]] == found[0].step
    assert dataclasses.replace(found[0], step=found[0].step + 1) != found[0]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_float64_models_numerics_verdict_names_float64_not_float32(mode: str) -> None:
    """log(0) after a ReLU in a float64 model: the reference ran in float64, and the verdict's words
    say so (they said 'non-finite in float32 eager too' whatever the dtype)."""
    model = zoo.lognet().double()
    x = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with nanhunt.watch(model, on_find="record", mode=mode) as hunt:
        model(x).sum().backward()
    f = hunt.first
    assert (f.module, f.verdict, f.dtype) == ("log", "numerics", "float64"), f
    for words in (str(f), text(Report([f]))):
        assert "float64 eager too" in words and "float32" not in words, words
