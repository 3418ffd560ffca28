"""The pytest plugin: `pytest --nanhunt` and the `nanhunt_watch` fixture, run on generated test
files through `pytester` (in a subprocess: an in-process run would import torch's lazily loaded
modules a second time)."""

from __future__ import annotations

import os
from importlib.metadata import entry_points
from pathlib import Path

import pytest

PLUGIN = "nanhunt.integrations.pytest_plugin"

TESTS = '''
import pytest
import torch
from torch import nn

import nanhunt


class LogHead(nn.Module):
    def forward(self, x):
        return torch.log(x.abs().sum(-1) * 0.0)  # log(0)


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), LogHead())


def test_nan_in_a_module():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        loss = model(torch.randn(3, 4)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_clean():
    model = nn.Linear(4, 2)
    for _ in range(3):
        assert torch.isfinite(model(torch.randn(3, 4))).all()


@pytest.mark.no_nanhunt
def test_nan_on_purpose():
    assert torch.isinf(net()(torch.randn(3, 4))).all()


def test_catches_everything():
    model = net()
    try:
        model(torch.randn(3, 4))
        model(torch.randn(3, 4))
    except Exception:
        pass  # swallows the NonFiniteError too: still a failure


def test_fails_on_its_own_after_a_nan():
    out = net()(torch.randn(3, 4))
    net()(torch.randn(3, 4))
    assert out.isfinite().all(), "the test's own assertion"


def test_expects_its_own_nonfinite_error():
    model = net()  # the test watches it itself and expects the error: its own hunt's business
    with pytest.raises(nanhunt.NonFiniteError):
        with nanhunt.watch(model):
            model(torch.randn(3, 4))


def test_fixture(nanhunt_watch):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hunt = nanhunt_watch(model, opt, on_find="record")
    model(torch.randn(3, 4)).mean().backward()
    opt.step()
    assert hunt.first is not None  # the test sees the finding, and still fails


def test_fixture_clean(nanhunt_watch):
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    nanhunt_watch(model, opt)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
'''


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    # Load the plugin by name only (an installed nanhunt registers it again through its entry point)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    root = str(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    pytester.makepyfile(test_models=TESTS)
    return pytester


def _outcomes(result: pytest.RunResult) -> dict[str, str]:
    out = {}
    for line in result.outlines:
        for word in ("PASSED", "FAILED"):
            if f" {word}" in line and "::" in line:
                out[line.split("::")[1].split()[0]] = word
    return out


def test_nanhunt_option_fails_tests_with_the_finding(suite):
    r = suite.runpytest_subprocess("-p", PLUGIN, "--nanhunt", "-v", "-p", "no:cacheprovider")
    assert _outcomes(r) == {
        "test_nan_in_a_module": "FAILED", "test_clean": "PASSED", "test_nan_on_purpose": "PASSED",
        "test_catches_everything": "FAILED", "test_fails_on_its_own_after_a_nan": "FAILED",
        "test_expects_its_own_nonfinite_error": "PASSED",
        "test_fixture": "FAILED", "test_fixture_clean": "PASSED",
    }, r.stdout.str()
    text = r.stdout.str()
    # the failure is the finding's summary and its line's text, not a traceback into nanhunt
    summary = ("nanhunt: First -Inf: forward of `1` (LogHead) at step 0 — output[0] = -inf, born here in "
               "aten.log.default at ")
    assert text.count(summary) >= 3, text
    assert "return torch.log(x.abs().sum(-1) * 0.0)  # log(0)" in text
    assert "nanhunt/_record" not in text and "NonFiniteError" not in text
    # a test that made it on purpose (pytest.raises around it) is told how to opt out; one that
    # asked for the watch itself (the fixture) is not
    # (counted in the failures' sections: the short summary repeats each message in full under CI=true)
    failures = text.split("short test summary info")[0]
    assert failures.count("(made on purpose? mark the test @pytest.mark.no_nanhunt)") == 2, text
    # a test that fails on its own keeps its own failure; the finding is added as a section
    assert "the test's own assertion" in text and "Captured nanhunt call" in text
    r.assert_outcomes(passed=4, failed=4)


def test_off_by_default_the_fixture_still_works(suite):
    r = suite.runpytest_subprocess("-p", PLUGIN, "-v", "-p", "no:cacheprovider")
    assert _outcomes(r) == {
        "test_nan_in_a_module": "PASSED", "test_clean": "PASSED", "test_nan_on_purpose": "PASSED",
        "test_catches_everything": "PASSED", "test_fails_on_its_own_after_a_nan": "FAILED",
        "test_expects_its_own_nonfinite_error": "PASSED",
        "test_fixture": "FAILED", "test_fixture_clean": "PASSED",
    }, r.stdout.str()
    assert "Captured nanhunt" not in r.stdout.str()


def test_the_fixture_used_twice_fails_with_the_value_made_first(suite):
    # the decoder's hunt was opened first, the encoder's log(0) made the -inf it was fed: the
    # failure named the decoder (the first hunt with a finding), not where the value was born
    suite.makepyfile(test_two='''
import torch
from torch import nn
from test_models import net


def test_encoder_feeds_decoder(nanhunt_watch):
    encoder, decoder = net(), nn.Linear(1, 2)
    nanhunt_watch(decoder, on_find="record")
    nanhunt_watch(encoder, on_find="record")
    decoder(encoder(torch.randn(3, 4))[:, None])
''')
    r = suite.runpytest_subprocess("-p", PLUGIN, "-p", "no:cacheprovider", "test_two.py")
    r.assert_outcomes(failed=1)
    text = r.stdout.str()
    assert "nanhunt: First -Inf: forward of `1` (LogHead) at step 0" in text, text
    assert "(Linear)" not in text and "no_nanhunt" not in text, text


def test_loading_the_plugin_imports_no_torch(pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    root = str(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    pytester.makepyfile(test_plain='''
import sys

def test_no_torch(request):
    assert request.config.pluginmanager.has_plugin("nanhunt.integrations.pytest_plugin")
    assert "torch" not in sys.modules and "nanhunt._record" not in sys.modules
''')
    r = pytester.runpytest_subprocess("-p", PLUGIN, "-p", "no:cacheprovider")
    r.assert_outcomes(passed=1)


def test_registered_as_a_pytest11_entry_point():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(__file__).resolve().parents[1]
    meta = tomllib.loads((root / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["pytest11"] == {"nanhunt": PLUGIN}
    installed = [ep for ep in entry_points(group="pytest11") if ep.name == "nanhunt"]
    for ep in installed:  # an install made before the entry point existed lists none
        assert ep.value == PLUGIN
