"""pytest: ``pytest --nanhunt`` and the ``nanhunt_watch`` fixture (registered through the
``pytest11`` entry point: installing nanhunt is enough).

- ``pytest --nanhunt``: while each test runs, every module it calls at the top level and every
  optimizer it steps are watched, as ``nanhunt run`` does for a script. A NaN/Inf fails the test
  with the finding's summary (and the text of its source line). A test that makes NaN/Inf on
  purpose opts out with ``@pytest.mark.no_nanhunt``.
- ``nanhunt_watch(model, optimizer=None, **watch_options)``: a fixture; calling it starts
  ``nanhunt.watch(...)`` for the rest of the test and returns the ``Hunt``. A finding fails the
  test, also when the test caught the ``NonFiniteError`` itself. Works with or without ``--nanhunt``
  (a test that uses it is not auto-watched as well).

Off by default: without ``--nanhunt`` and the fixture nothing is watched, and this module imports
neither torch nor the rest of nanhunt (pytest loads it in every run where nanhunt is installed).
"""

from __future__ import annotations

import linecache
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .._finding import Finding
    from .._record import Hunt

__all__ = ["nanhunt_watch"]

_HUNTS = pytest.StashKey[list["Hunt"]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("nanhunt", "nanhunt: find the first NaN/Inf")
    group.addoption("--nanhunt", action="store_true", default=False,
                    help="watch every module each test calls; a NaN/Inf fails the test with where it was born")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "no_nanhunt: not watched under --nanhunt (the test makes NaN/Inf on purpose)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    auto = None
    if (item.config.getoption("nanhunt") and item.get_closest_marker("no_nanhunt") is None
            and "nanhunt_watch" not in getattr(item, "fixturenames", ())):
        from .._cli.auto import AutoWatch

        auto = AutoWatch(on_find="raise")
    try:
        result = yield
    except BaseException as e:
        found = _finish(auto, item)
        from .._finding import NonFiniteError

        if isinstance(e, NonFiniteError):
            raise _failure(e.finding, auto is not None) from None
        if found is not None:  # the test failed on its own after a NaN/Inf: say where that was born
            item.add_report_section("call", "nanhunt", _message(found))
        raise
    found = _finish(auto, item)
    if found is not None:
        raise _failure(found, auto is not None)
    return result


def _finish(auto: Any, item: pytest.Item) -> Finding | None:
    """Close the auto-watch and the fixture's hunts (nothing pending is raised); the first finding:
    of several hunts, the one whose value was made first (an encoder's log(0), not the decoder it
    fed, whichever hunt the test opened first)."""
    found = None
    if auto is not None:
        auto.close()
        own = auto.own_findings()  # a hunt the test opened itself is the test's business
        found = own[0] if own else None
    hunts = item.stash.get(_HUNTS, [])
    for hunt in hunts:
        hunt.close(raise_pending=False)
    firsts = [(h.occurred(f), f) for h in hunts if (f := h.first) is not None]
    if found is None and firsts:
        found = min(firsts, key=lambda t: t[0])[1]  # (on the event clock all hunts share)
    return found


def _message(f: Finding) -> str:
    msg = f"nanhunt: {f.summary()}"
    path, _, line = (f.source or "").rpartition(":")
    text = linecache.getline(path, int(line)).strip() if path and line.isdigit() else ""
    return f"{msg}\n    {f.source}: {text}" if text else msg


def _failure(f: Finding, auto: bool) -> BaseException:
    """pytest's own failure outcome (its message only, no traceback into nanhunt); under
    ``--nanhunt`` (``auto``), how a test that makes the value on purpose opts out."""
    msg = _message(f)
    if auto:
        msg += "\n    (made on purpose? mark the test @pytest.mark.no_nanhunt)"
    try:
        pytest.fail(msg, pytrace=False)
    except pytest.fail.Exception as e:
        return e
    raise AssertionError("pytest.fail returned")  # pragma: no cover


@pytest.fixture
def nanhunt_watch(request: pytest.FixtureRequest) -> Generator[Callable[..., Hunt], None, None]:
    """``nanhunt_watch(model, optimizer=None, **watch_options)``: watch for the rest of the test."""
    hunts = request.node.stash.setdefault(_HUNTS, [])

    def start(model: Any, optimizer: Any = None, **watch_options: Any) -> Hunt:
        import nanhunt

        hunt = nanhunt.watch(model, optimizer, **watch_options)
        hunts.append(hunt)
        return hunt

    yield start
    for hunt in hunts:  # already closed after the call phase; this covers a failed setup
        hunt.close(raise_pending=False)
    hunts.clear()
