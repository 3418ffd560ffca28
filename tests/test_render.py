"""Renderers: the terminal answer, rich, and the self-contained HTML page (also in a real browser)."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import shutil
import subprocess

import pytest

from nanhunt import Finding, Report
from nanhunt._report.render import heatmap_svg, html, text
from nanhunt._words import headline, paragraph

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
REGEN = os.environ.get("NANHUNT_REGEN_GOLDEN") == "1"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def softmax_finding(**kw) -> Finding:
    base = dict(
        phase="forward", module="layers.3.attn", module_type="Attention", tensor="output", step=41, call=0,
        index=(0, 5, 2), value=float("nan"), counts={"nan": 16, "+inf": 0, "-inf": 0}, shape=(2, 8, 4),
        dtype="float16", cause="created", op="aten._softmax.default", source="model.py:42",
        chain=("aten.masked_fill.Scalar @ model.py:41", "aten._softmax.default @ model.py:42"),
        reproducible=True, hint="A softmax over a row that is entirely -inf (a fully masked row) gives nan.",
    )
    base.update(kw)
    return Finding(**base)


def history() -> dict:
    mods = ["", "embed", "layers.3.attn", "layers.3.mlp"]
    steps = [36, 37, 38, 39, 40]
    absmax = [
        [1.0, 2.0, 4.0, 8.0, 16.0],
        [0.5, 0.5, 0.5, None, 0.5],
        [10.0, 100.0, 1000.0, 30000.0, "inf"],
        [0.0, 1e-3, 2e-3, "nan", 4e-3],
    ]
    return {
        "steps": steps, "modules": mods, "dtype": {m: "float16" for m in mods}, "absmax": absmax,
        "rms": [[0.1] * 5 for _ in mods], "zeros": [[0.0] * 5 for _ in mods],
        "headroom": [[65504.0] * 5 for _ in mods],
    }


def report(**kw) -> Report:
    first = softmax_finding()
    later = softmax_finding(phase="backward", module="layers.3", module_type="Block", tensor="grad_input[0]",
                            cause="input", op=None, source=None, chain=(), hint="")
    warnings = [
        {"kind": "near_overflow", "module": "layers.3.attn", "step": 39, "message": "abs-max 30000 is within 2x of "
         "float16's largest value 65504"},
        {"kind": "scale_falling", "module": None, "step": 40, "message": "the loss scale fell 4 times in a row"},
    ]
    return Report([first, later], history=kw.get("history", history()), warnings=warnings,
                  meta={"steps": 42, "mode": "full"})


def check_golden(name: str, got: str) -> None:
    path = os.path.join(GOLDEN, name)
    if REGEN or not os.path.exists(path):
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(got)
    with open(path, encoding="utf-8") as fh:
        assert got == fh.read(), f"rendering changed; regenerate with NANHUNT_REGEN_GOLDEN=1 ({path})"


def test_first_line_is_the_one_sentence_answer():
    first = text(report()).splitlines()[0]
    assert first == (
        "First NaN: forward of `layers.3.attn` (Attention) at step 41 — output[0, 5, 2] = nan, "
        "born here in aten._softmax.default at model.py:42."
    )
    assert str(report()).splitlines()[0] == first


def test_terminal_text_golden():
    check_golden("test_terminal_text_golden.txt", text(report()))


def test_text_has_details_warnings_and_all_findings():
    out = text(report())
    for want in ("layers.3.attn (Attention)", "(2, 8, 4)", "float16", "[0, 5, 2] = nan", "16 nan", "created",
                 "aten.masked_fill.Scalar @ model.py:41", "fully masked row", "Early warnings (2)",
                 "within 2x of float16", "All findings (2", "grad_input[0]"):
        assert want in out, want


@pytest.mark.parametrize(
    ("kw", "start"),
    [
        (dict(phase="backward", tensor="grad_input[0]", op="SqrtBackward0", source="m.py:3", value=float("inf")),
         "First +Inf: backward of `layers.3.attn` (Attention) at step 41 — grad_input[0][0, 5, 2] = inf, born here "
         "in SqrtBackward0 at m.py:3."),
        (dict(phase="check", module="loss", value=float("-inf"), cause="input", op=None, call=2, index=()),
         "First -Inf: checked tensor `loss` at step 41 (call 2) — output = -inf, fed in by a non-finite input."),
        (dict(phase="optimizer", module="", module_type="Net", tensor="state['exp_avg_sq']", index=None, value=None,
              counts={"nan": 0, "+inf": 3, "-inf": 0}, cause="parameter", op=None, rank=1),
         "First +Inf: optimizer step, in `<model>` (Net) at step 41 — state['exp_avg_sq'], from a non-finite "
         "parameter or buffer (poisoned weights) (rank 1)."),
    ],
)
def test_headline_phases(kw, start):
    assert headline(softmax_finding(**kw)) == start


def test_no_finding():
    r = Report()
    assert text(r) == "nanhunt: no NaN/Inf found."
    page = html(r)
    assert "no NaN/Inf found" in page and "No magnitude history" in page


def test_rich_renders_colour_and_table():
    rich = pytest.importorskip("rich.console")
    buf = io.StringIO()
    rich.Console(file=buf, width=120, color_system="truecolor", force_terminal=True).print(report())
    out = buf.getvalue()
    assert "\x1b[" in out  # colour
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    assert plain.splitlines()[0].startswith("First NaN: forward of `layers.3.attn`")
    assert "element" in plain and "[0, 5, 2] = nan" in plain and "Early warnings" in plain


def assert_self_contained(page: str) -> None:
    low = page.lower()
    assert "<script src" not in low and not re.search(r"<script[^>]*\bsrc\s*=", low)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", low)
    assert not re.search(r"<link\b", low)
    assert "@import" not in low and "url(" not in low


def test_html_is_self_contained_with_heatmap_and_marked_finding():
    page = html(report())
    assert_self_contained(page)
    assert page.count("<svg") == 1 and "<rect" in page
    assert 'class="finding"' in page
    assert "First NaN: forward of `layers.3.attn` (Attention) at step 41" in page
    assert "within 2x of float16" in page and "aten.masked_fill.Scalar @ model.py:41" in page
    assert "<title>layers.3.attn @ step 40 · abs-max inf" in page  # nan/inf strings decoded


def _cell(svg: str, module: str, step: int) -> tuple[float, float, float, float]:
    """x, y, width, height of the heatmap cell of ``module`` at ``step``."""
    cells = re.findall(r'<rect x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" height="([\d.]+)" fill="[^"]+"><title>'
                       + re.escape(f"{module} @ step {step} "), svg)
    assert len(cells) == 1, cells
    return tuple(float(v) for v in cells[0])  # type: ignore[return-value]


def test_heatmap_marks_the_finding_cell():
    svg = heatmap_svg(history(), ("layers.3.attn", 38))
    m = re.search(r'<rect class="finding" x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" height="([\d.]+)"', svg)
    assert m is not None
    x, y, w, h = _cell(svg, "layers.3.attn", 38)
    fx, fy, fw, fh = (float(v) for v in m.groups())
    assert fx < x and fy < y and fx + fw > x + w and fy + fh > y + h  # the outline surrounds that cell
    assert fx + fw < x + 2 * w and fy + fh < y + 2 * h  # and only that one
    assert "layers.3.attn @ step 38 · abs-max nan · the finding" in svg


def test_heatmap_handles_missing_and_ragged_history():
    assert heatmap_svg({}, None) == ""
    assert heatmap_svg({"steps": [], "modules": []}, None) == ""
    svg = heatmap_svg({"steps": [1, 2], "modules": ["a"], "absmax": [[1.0]]}, ("zzz", 9))
    assert "<svg" in svg and 'class="finding"' in svg  # unknown module: the step column is marked
    page = html(report(history={}))
    assert "No magnitude history" in page
    assert_self_contained(page)


def test_json_round_trip_renders_the_same(tmp_path):
    r = report()
    path = r.save(tmp_path / "r.json")
    back = Report.load(path)
    assert text(back) == text(r)
    assert html(back) == html(r)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium installed")
def test_html_in_headless_browser(tmp_path):
    page = tmp_path / "report.html"
    page.write_text(html(report()), encoding="utf-8")
    png = tmp_path / "shot.png"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1100,1300", f"--screenshot={png}",
           page.as_uri()]
    try:
        subprocess.run(cmd, capture_output=True, timeout=90, check=False)
    except subprocess.TimeoutExpired:
        pytest.skip("chromium did not finish in time")
    if not png.exists():
        pytest.skip("chromium wrote no screenshot")
    image = pytest.importorskip("matplotlib.image")
    pixels = image.imread(str(png))[..., :3]
    assert pixels.shape[0] >= 1000 and pixels.shape[1] >= 1000

    def has(rgb: tuple[int, int, int]) -> bool:
        target = [c / 255 for c in rgb]
        d = abs(pixels[..., 0] - target[0]) + abs(pixels[..., 1] - target[1]) + abs(pixels[..., 2] - target[2])
        return bool((d < 0.03).sum() > 20)

    assert has((0x00, 0xB3, 0xFF))  # the finding's outline was drawn
    assert has((0x11, 0x11, 0x11))  # a non-finite cell
    assert has((0xFF, 0xF2, 0xF0))  # the answer box


def test_a_precision_reference_whose_value_fits_does_not_say_it_overflowed():
    from nanhunt._words import reference_text

    # float16 GELU's backward: pow gives inf, then * 0 gives nan; float32's gradient there is 0
    fits = softmax_finding(phase="backward", verdict="precision", op="PowBackward0", value=float("nan"),
                           reference={"dtype": "float32", "op": "PowBackward0", "value": 0.0, "limit": 65504.0,
                                      "failing_dtype": "float16", "failing": float("nan")})
    line = reference_text(fits)
    assert "past float16's largest value" not in line
    assert "within float16's range" in line and "65504" in line and "(failing run: nan)" in line
    over = dataclasses.replace(fits, reference={**fits.reference, "value": 90112.0})
    assert "= 90112, past float16's largest value 65504" in reference_text(over)


def test_a_finding_with_no_tensor_left_says_so_and_a_transient_one_names_python_state():
    from nanhunt._words import details, remedy

    f = softmax_finding(index=None, value=None, counts={}, shape=(), dtype="", cause="unknown", op=None,
                        source=None, chain=(), reproducible=False, verdict="transient", reference={})
    rows = dict(details(f))
    assert "shape ()" not in rows["tensor"] and "unknown" in rows["tensor"]
    assert "Python state in forward" in remedy(f)


def test_control_characters_in_names_never_reach_the_message_raw() -> None:
    # a module name is the user's data: a newline in it faked a second "First NaN:" line, an escape
    # sequence cleared the terminal, in the error message, warnings, the log and the .txt report
    import torch
    from torch import nn

    import nanhunt

    model = nn.Sequential()
    model.add_module("a\x1b[2J\nFirst NaN: forward of `decoy`\u202e", nn.Linear(2, 2))
    with pytest.raises(nanhunt.NonFiniteError) as ei, nanhunt.watch(model):
        model(torch.tensor([[float("nan"), 1.0]]))
        model(torch.ones(1, 2))
    assert "\n" not in str(ei.value)  # the message is one paragraph
    for said in (str(ei.value), str(ei.value.report)):
        assert "\x1b" not in said and "\u202e" not in said, said
        assert not any(line.startswith("First NaN: forward of `decoy`") for line in said.splitlines()), said
        assert "\\x1b[2J\\x0aFirst NaN: forward of `decoy`\\u202e" in said, said
    assert ei.value.finding.module.startswith("a\x1b[2J\n")  # the data itself is unchanged


def test_a_name_that_is_a_terminal_command_is_shown_escaped_in_every_part_of_every_format(tmp_path) -> None:
    """A module name from user data (a ModuleDict key) holding a newline, an escape sequence and a
    bidi override, here the module with the loaded NaN weight: the hint naming it, the damage list,
    the list of all findings, the early warnings and the heatmap's labels wrote it raw (a fake
    "First NaN:" line in the terminal and the .txt, `ESC]0;...BEL` setting the terminal's title
    under `nanhunt show`/`nanhunt run` on a terminal, raw control characters in the .html; the
    NonFiniteError's message, one paragraph, held the hint's newline)."""
    import torch
    from torch import nn

    import nanhunt

    bad = "x\x1b]0;owned\x07\x1b[2J\nFirst NaN: fake\u202e"
    torch.manual_seed(0)
    model = nn.ModuleDict({bad: nn.Linear(4, 4), "head": nn.Linear(4, 1)})
    with torch.no_grad():
        model[bad].weight[0, 0] = float("nan")  # a poisoned checkpoint's weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hunt = nanhunt.watch(model, opt, on_find="record")
    for _ in range(2):
        opt.zero_grad()
        model["head"](model[bad](torch.ones(2, 4))).sum().backward()
        opt.step()
    hunt.close()
    report = hunt.report
    report.warnings.append({"step": 1, "module": bad, "message": f"`{bad}` output abs-max grows"})
    report.history["dtype"]["head"] = "float32\x1b[2J"  # (a crafted report's: in the heatmap's tooltips)
    assert report.first is not None and report.first.module == bad and bad in report.first.hint
    assert len(report.findings) > 1 and report.damage_known
    rich = pytest.importorskip("rich.console")
    buf = io.StringIO()
    rich.Console(file=buf, width=200, color_system="truecolor", force_terminal=True).print(report)
    shown = {"text": str(report), "rich": re.sub(r"\x1b\[[0-9;]*m", "", buf.getvalue()), "html": report.to_html(),
             "message": paragraph(report.first)}
    for fmt, said in shown.items():
        assert not re.search("[\x00-\x08\x0b-\x1f\x7f\u202e]", said), (fmt, said)
        assert not any(line.lstrip().startswith("First NaN: fake") for line in said.splitlines()), (fmt, said)
        assert "\\x1b]0;owned\\x07\\x1b[2J\\x0aFirst NaN: fake\\u202e" in said, fmt
