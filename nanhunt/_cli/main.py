"""Command line: ``nanhunt run|demo|show|replay|audit`` (also ``python -m nanhunt``).

Exit status: 0 fine; 1 the script failed or a replay did not reproduce; 2 bad usage or a file that
cannot be read; 3 a NaN/Inf was found (``run``, ``audit``). ``run`` otherwise passes on the script's own status.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import traceback
from typing import Any

from .._report import print_report
from . import audit

__all__ = ["main"]

EXIT_FOUND = 3
EXIT_USAGE = 2


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if ns.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(ns.func(ns))
    except BrokenPipeError:  # `nanhunt show r.json | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nanhunt", description="Find the first NaN/Inf in a PyTorch run.")
    sub = p.add_subparsers(dest="command", metavar="{run,demo,show,replay,audit}")

    r = sub.add_parser("run", help="run an unmodified script with every model and optimizer watched",
                       description="Run SCRIPT as `python SCRIPT ARGS...` would, watching every module it calls at "
                       "the top level and every optimizer it steps. Exits 3 after a NaN/Inf, printing the answer; "
                       "otherwise with the script's own status. Under torchrun: "
                       "`torchrun --no-python ... nanhunt run train.py` (the report path gets a .rankN suffix).")
    r.add_argument("--report", metavar="PATH", help="write the report here (.json, .html or .txt)")
    r.add_argument("--on-find", choices=("raise", "warn", "record"), default="raise",
                   help="raise: stop the script at the first finding (default); warn/record: let it go on")
    r.add_argument("--bundle", metavar="PATH", help="save the first failing call here (.pt) for `nanhunt replay`")
    r.add_argument("--mode", choices=("full", "sentinel", "ops"), default="full",
                   help="full: check every module (default); sentinel: cheaper, localise by replay on a hit; "
                        "ops: check every op from the start (slow)")
    r.add_argument("--history", type=int, default=32, metavar="N", help="steps of magnitude history kept (32)")
    r.add_argument("script", help="the Python script to run")
    r.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    r.set_defaults(func=_cmd_run)

    d = sub.add_parser("demo", help="train a tiny model that blows up, and show the report")
    d.add_argument("--out", default="nanhunt-demo.html", metavar="PATH", help="HTML report (nanhunt-demo.html)")
    d.add_argument("--report", metavar="PATH", help="also write the report here (.json or .txt)")
    d.add_argument("--steps", type=int, default=None, metavar="N",
                   help="at most N training steps (default 300, or $NANHUNT_DEMO_STEPS)")
    d.set_defaults(func=_cmd_demo)

    s = sub.add_parser("show", help="render a saved JSON report")
    s.add_argument("report", help="a report written as .json")
    s.add_argument("--html", metavar="PATH", help="also write it as a self-contained HTML page")
    s.set_defaults(func=_cmd_show)

    b = sub.add_parser("replay", help="re-run a saved failing module on its saved inputs")
    b.add_argument("bundle", help="a repro bundle (loaded with weights_only=True: it can never run code)")
    b.add_argument("--device", default=None, help="run on this device (default: the saved one if present)")
    b.set_defaults(func=_cmd_replay)

    audit.add_parser(sub)
    return p


def _err(msg: str) -> None:
    print(f"nanhunt: {msg}", file=sys.stderr)


# ---------------------------------------------------------------- show
def _cmd_show(ns: argparse.Namespace) -> int:
    from .._report import Report

    try:
        report = Report.load(ns.report)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        _err(f"cannot read report {ns.report!r}: {e}")
        return EXIT_USAGE
    print_report(report, sys.stdout)
    if ns.html:
        try:
            report.save(_with_suffix(ns.html, ".html"))
        except (OSError, ValueError) as e:
            _err(f"cannot write {ns.html!r}: {e}")
            return EXIT_USAGE
    return 0


def _with_suffix(path: str, suffix: str) -> str:
    if os.path.splitext(path)[1].lower() != suffix:
        raise ValueError(f"the path must end in {suffix}")
    return path


# ---------------------------------------------------------------- replay
def _cmd_replay(ns: argparse.Namespace) -> int:
    from .._locate import BundleError, replay

    try:
        result = replay(ns.bundle, device=ns.device)
    except BundleError as e:
        _err(str(e))
        return EXIT_USAGE
    print(result.summary())
    exp = result.expected
    if exp is not None:
        print(f"saved finding: {exp.summary()}")
    return 0 if result.reproduced else 1


# ---------------------------------------------------------------- demo
def _cmd_demo(ns: argparse.Namespace) -> int:
    from . import demo as _demo

    try:
        out = _with_suffix(ns.out, ".html")
        if ns.report and os.path.splitext(ns.report)[1].lower() not in (".json", ".txt", ".html"):
            raise ValueError("--report must end in .json, .txt or .html")
    except ValueError as e:
        _err(str(e))
        return EXIT_USAGE
    return _demo.main(out=out, steps=ns.steps, report=ns.report)


# ---------------------------------------------------------------- run
def rank_path(path: str, rank: str | None = None) -> str:
    """``report.json`` -> ``report.rank1.json`` when ``RANK`` is set (torchrun), else unchanged."""
    rank = os.environ.get("RANK") if rank is None else rank
    if not rank:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext}"


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _cmd_run(ns: argparse.Namespace) -> int:
    script = ns.script
    if not os.path.isfile(script):
        _err(f"no such script: {script!r}")
        return EXIT_USAGE
    report_path = None
    if ns.report:
        report_path = rank_path(ns.report)
        parent = os.path.dirname(os.path.abspath(report_path))
        if os.path.splitext(report_path)[1].lower() not in (".json", ".html", ".txt"):
            _err(f"--report must end in .json, .html or .txt; got {ns.report!r}")
            return EXIT_USAGE
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            _err(f"--report {ns.report!r}: folder {parent!r} does not exist or is not writable")
            return EXIT_USAGE
    if ns.history < 0:
        _err("--history must be >= 0")
        return EXIT_USAGE

    extra = {}
    if ns.bundle:
        from .._files import check_writable

        try:
            extra["bundle"] = check_writable(rank_path(ns.bundle), (".pt",), "--bundle")
        except (ValueError, PermissionError) as e:
            _err(str(e))
            return EXIT_USAGE

    from .._finding import NonFiniteError
    from .auto import AutoWatch

    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [script, *ns.args]
    here = os.path.dirname(os.path.abspath(script))
    if sys.path:
        sys.path[0] = here  # as `python script.py` sets it
    else:
        sys.path.insert(0, here)
    code = 0
    raised: NonFiniteError | None = None
    auto = AutoWatch(on_find=ns.on_find, mode=ns.mode, history=ns.history, **extra)
    try:
        runpy.run_path(script, run_name="__main__")
    except NonFiniteError as e:
        raised = e
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            auto.close()
        finally:
            sys.argv = saved_argv
            sys.path[:] = saved_path
    report = auto.report()
    if not report.findings and raised is not None:  # the script's own nanhunt.watch raised
        report = raised.report if raised.report is not None else type(report)([raised.finding])
    if report_path is not None:
        try:
            report.save(report_path)
        except OSError as e:
            _err(f"cannot write the report to {report_path!r}: {e}")
    if report.findings:
        print("", file=sys.stderr)
        print_report(report, sys.stderr)
        if report_path is not None:
            print(f"\nnanhunt: report written to {report_path}", file=sys.stderr)
        return EXIT_FOUND
    return code
