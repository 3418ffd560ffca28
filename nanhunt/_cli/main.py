"""Command line: ``nanhunt run|demo|show|replay|audit`` (also ``python -m nanhunt``).

Exit status (every command):

- 0: clean — no NaN/Inf (``run``: the script finished; ``replay``: the saved call ran finite).
- 1: the script's own failure (``run``: it raised; ``replay``: the module raised).
- 2: usage — a bad option, or a file that cannot be read or written (checked before any work).
- 3: a NaN/Inf was found (``run``: in the script; ``replay``: the replay reproduced it; ``audit``:
  a checkpoint holds one).

``run`` otherwise passes on the script's own ``sys.exit`` status; when that is not 0, a line on
stderr says that no NaN/Inf was found and the status is the script's own (a script's own 3 is no
finding). Every error is one line on stderr.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import itertools
import json
import os
import re
import runpy
import shutil
import sys
import tempfile
import traceback
import zipfile
from typing import Any, NoReturn

from .._report import print_report
from .._words import one_line
from . import audit

__all__ = ["main"]

EXIT_CLEAN = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_FOUND = 3


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, naming the command and where its help is."""

    run: argparse.ArgumentParser  # (the top parser's: its `run` subcommand)
    commands: dict[str, argparse.ArgumentParser]  # (the top parser's: each subcommand's parser)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _at_least_1(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1; got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {n}")
    return n


def _run_module(run: argparse.ArgumentParser, argv: list[str]) -> tuple[tuple[str, list[str]] | None, list[str]]:
    """``run``'s ``-m MODULE args...`` (as ``python -m``: everything after the module is its own),
    taken out of ``argv`` before argparse, which would read the module's options as nanhunt's:
    ((module, its args), nanhunt's own argv), or (None, argv) when the run names a script. ``run``:
    the subcommand's parser (which of its options take a value)."""
    if not argv or argv[0] != "run":
        return None, argv
    valued = {s for a in run._actions if a.option_strings and a.nargs != 0 for s in a.option_strings}
    i = 1
    while i < len(argv):
        a = argv[i]
        if a == "-m":
            return (argv[i + 1] if i + 1 < len(argv) else "", argv[i + 2:]), argv[:i]
        if a.startswith("-m") and not a.startswith("--"):  # (-mpackage.train, as python takes it)
            return (a[2:], argv[i + 1:]), argv[:i]
        if a in valued:
            i += 2
        elif a.startswith("-"):
            i += 1
        else:
            break  # the script: the rest is its own
    return None, argv


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    module, argv = _run_module(parser.run, argv)
    try:
        ns, unknown = parser.parse_known_args(argv)
        if unknown:  # (named by the subcommand whose options they were given among: its --help lists them)
            (parser.commands.get(ns.command) or parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as e:  # --help, --version, a usage error: a status, not an exception
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    if module is not None:  # `nanhunt run [options] -m MODULE [args...]`
        if not module[0] or module[0].startswith("-"):
            return _usage(ns.parser, "-m takes a module name (nanhunt run -m package.train ...)")
        ns.module, ns.args = module
    if ns.command == "run" and ns.script is None and ns.module is None:  # (optional in the grammar: `args` may be empty)
        return _usage(ns.parser, "the following argument is required: script (or -m MODULE)")
    if ns.command == "run" and argv[-len(ns.args) - 2:][:2] == [ns.script, "--"]:
        ns.args = ["--", *ns.args]  # (argparse drops a `--` right after the script; python passes it on)
    if ns.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(ns.func(ns))
    except BrokenPipeError:  # `nanhunt show r.json | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _parser() -> _Parser:
    p = _Parser(prog="nanhunt", description="Find the first NaN/Inf in a PyTorch run.",
                epilog="Exit status: 0 clean, 1 the script's own failure, 2 usage error, 3 a NaN/Inf was found; "
                       "`run` passes on the script's own sys.exit status, saying on stderr that it is the "
                       "script's and that no NaN/Inf was found.")
    p.add_argument("--version", action=_Version, nargs=0, help="show the versions of nanhunt and torch and exit")
    sub = p.add_subparsers(dest="command", metavar="{run,demo,show,replay,audit}")

    r = sub.add_parser("run", help="run an unmodified script with every model and optimizer watched",
                       description="Run SCRIPT as `python SCRIPT ARGS...` would, watching every module it calls at "
                       "the top level and every optimizer it steps. Exits 3 after a NaN/Inf, printing the answer; "
                       "otherwise with the script's own status (a non-zero one, its own sys.exit(3) too, with "
                       "a line on stderr saying no NaN/Inf was found). Under torchrun: "
                       "`torchrun ... -m nanhunt run train.py`: every rank is watched, rank 0 prints and writes "
                       "the report with every rank's findings, and every rank exits 3 after a finding.")
    r.add_argument("--report", metavar="PATH", help="write the report here (.json, .html or .txt)")
    r.add_argument("--on-find", choices=("raise", "warn", "record"), default="raise",
                   help="raise: stop the script at the first finding (default); warn/record: let it go on")
    r.add_argument("--pdb", action="store_true",
                   help="at the first finding, Python's breakpoint() inside a replay of the failing op (locals "
                        "finding, op, args, out; PYTHONBREAKPOINT is honoured), then stop as --on-find raise")
    r.add_argument("--bundle", metavar="PATH", help="save the first failing call here (.pt) for `nanhunt replay`")
    r.add_argument("--mode", choices=("full", "sentinel", "ops"), default="full",
                   help="full: check every module (default); sentinel: cheaper, localise by replay on a hit; "
                        "ops: check every op from the start (slow)")
    r.add_argument("--history", type=int, default=32, metavar="N", help="steps of magnitude history kept (32)")
    r.add_argument("--dist-timeout", type=float, default=300.0, metavar="S",
                   help="under torch.distributed: seconds to wait for the other ranks before naming the silent ones "
                        "(300)")
    r.add_argument("-m", dest="module", metavar="MODULE",
                   help="run a module as `python -m MODULE args...` would (the arguments after it are its own), "
                        "instead of a script")
    r.add_argument("script", nargs="?", help="the Python script to run (required, unless -m MODULE)")
    r.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments (optional)")
    r.set_defaults(func=_cmd_run, parser=r)

    d = sub.add_parser("demo", help="train a tiny model that blows up, and show the report")
    d.add_argument("--out", default=None, metavar="PATH",
                   help=f"HTML report (default {os.path.join(tempfile.gettempdir(), DEMO_PAGE)})")
    d.add_argument("--report", metavar="PATH", help="also write the report here (.json or .txt)")
    d.add_argument("--steps", type=_at_least_1, default=None, metavar="N",
                   help="at most N training steps (default 300, or $NANHUNT_DEMO_STEPS)")
    d.set_defaults(func=_cmd_demo)

    s = sub.add_parser("show", help="render a saved JSON report")
    s.add_argument("report", help="a report written as .json")
    s.add_argument("--html", metavar="PATH", help="also write it as a self-contained HTML page")
    s.set_defaults(func=_cmd_show)

    b = sub.add_parser("replay", help="re-run a saved failing module on its saved inputs")
    b.add_argument("bundle", help="a repro bundle (loaded with weights_only=True: it can never run code)")
    b.add_argument("--device", default=None, help="run on this device (default: the saved one if present)")
    b.add_argument("--module", metavar="MODULE:NAME", default=None,
                   help="your own module class when the failing module is not a torch.nn layer: "
                        "package.module:Class or path/to/file.py:Class (imported because you name it here, "
                        "never because the bundle does); NAME may also be a function that returns the module")
    b.set_defaults(func=_cmd_replay)

    audit.add_parser(sub)
    p.run = r  # (`run -m` reads which of its options take a value)
    p.commands = dict(sub.choices)
    return p


DEMO_PAGE = "nanhunt-demo.html"


def _version() -> str:
    import torch

    from .. import __version__

    return f"nanhunt {__version__} (torch {torch.__version__})"


class _Version(argparse.Action):
    """``--version``: torch is imported only when it is asked for (every command would pay for it
    otherwise, and the demo must set its float code paths before torch is imported)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(_version())
        parser.exit()


def _err(msg: str) -> None:
    print(f"nanhunt: {one_line(msg)}", file=sys.stderr)  # (a file name from a folder's listing is data)


def _usage(parser: argparse.ArgumentParser, msg: str) -> int:
    print(f"{parser.prog}: error: {one_line(msg)} (see '{parser.prog} --help')", file=sys.stderr)
    return EXIT_USAGE


# ---------------------------------------------------------------- show
def _cmd_show(ns: argparse.Namespace) -> int:
    from .._files import check_writable, not_a_file
    from .._report import Report

    if ns.html:
        try:
            check_writable(ns.html, (".html",), "--html")
        except (ValueError, PermissionError) as e:
            _err(str(e))
            return EXIT_USAGE
    why = not_a_file(ns.report)  # a folder, /dev/zero, a FIFO: named, never read
    if why is not None:
        said = why.removeprefix("cannot be read: ") if why.startswith("cannot be read: ") else f"it {why}"
        _err(f"cannot read report {ns.report!r}: {said}" + (", not a report file" if why.startswith("is ") else ""))
        return EXIT_USAGE
    if zipfile.is_zipfile(ns.report):
        _err(f"{ns.report} is a torch.save file (a bundle?), not a report: replay a bundle with "
             f"`nanhunt replay {ns.report}`")
        return EXIT_USAGE
    try:
        report = Report.load(ns.report)  # at most MAX_REPORT_BYTES are read
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        suffix = os.path.splitext(ns.report)[1].lower()
        if suffix in (".html", ".txt"):  # a rendering of a report, not the report itself
            _err(f"cannot read report {ns.report!r}: `nanhunt show` reads the .json report (a {suffix} file is "
                 "already a rendering of one: open it as it is)")
        else:
            _err(f"cannot read report {ns.report!r}: {_one_line(e)}")
        return EXIT_USAGE
    if ns.html:
        try:
            report.save(ns.html)
        except OSError as e:
            _err(f"cannot write {ns.html!r}: {e}")
            return EXIT_USAGE
    print_report(report, sys.stdout)
    return EXIT_CLEAN


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# ---------------------------------------------------------------- replay
def _cmd_replay(ns: argparse.Namespace) -> int:
    from .._files import not_a_file
    from .._locate import BundleError, replay

    why = not_a_file(ns.bundle)  # a folder, /dev/zero, a FIFO: named, never read
    if why == "does not exist":
        _err(f"no such bundle file: {ns.bundle!r}")
        return EXIT_USAGE
    if why is not None:
        _err(f"{ns.bundle} {why}" + (", not a bundle file" if why.startswith("is ") else ""))
        return EXIT_USAGE
    module = None
    if ns.module:
        from .target import TargetError, load_target, module_of

        try:
            module = module_of(load_target(ns.module), ns.module)
        except TargetError as e:
            _err(str(e))
            return EXIT_USAGE
    try:
        result = replay(ns.bundle, module, device=ns.device)
    except BundleError as e:
        _err(_one_line(e))
        return EXIT_USAGE
    print(one_line(result.summary()))  # the bundle's names are data (someone else's file)
    exp = result.expected
    if exp is not None:
        print(f"saved finding: {exp.summary()}")
    if result.error is not None:
        return EXIT_FAILED
    return EXIT_FOUND if result.finding is not None else EXIT_CLEAN


# ---------------------------------------------------------------- demo
# The demo's numbers (the blow-up step, the element) depend on the float code paths: MKL's matmul
# kernels and ATen's vector kernels differ between CPUs (AVX2, AVX-512) and round differently. Its
# process takes the portable ones (read when torch first runs them), so every x86 machine prints
# the same report as the README. Set for the demo's own process only, before torch is imported.
DEMO_ENV = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default"}


def _cmd_demo(ns: argparse.Namespace) -> int:
    if "torch" not in sys.modules:
        os.environ.update(DEMO_ENV)
    from .._files import check_writable
    from . import demo as _demo

    try:
        out = check_writable(ns.out or os.path.join(tempfile.gettempdir(), DEMO_PAGE), (".html",), "--out")
        if ns.report:
            check_writable(ns.report, (".json", ".txt", ".html"), "--report")
    except (ValueError, PermissionError) as e:
        _err(str(e))
        return EXIT_USAGE
    return _demo.main(out=out, steps=ns.steps, report=ns.report)


# ---------------------------------------------------------------- run
def rank_path(path: str, rank: str | None = None) -> str:
    """``report.json`` -> ``report.rank1.json`` when ``RANK`` is set (torchrun), else unchanged."""
    from .._files import rank_path as ranked

    return ranked(path, os.environ.get("RANK") if rank is None else rank)


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _cmd_run(ns: argparse.Namespace) -> int:
    script = ns.script
    from .._files import not_a_file

    if ns.module is not None:
        try:  # (as `python -m` finds it: the current folder first; a package runs its __main__)
            sys.path.insert(0, os.getcwd())
            try:
                spec = importlib.util.find_spec(ns.module)
                if spec is not None and spec.submodule_search_locations is not None:
                    spec = importlib.util.find_spec(f"{ns.module}.__main__")
            finally:
                sys.path.pop(0)
        except (ImportError, ValueError):
            spec = None
        if spec is None or spec.origin is None or not os.path.isfile(spec.origin):
            _err(f"no module named {ns.module!r} to run (as python -m {ns.module} would, from {os.getcwd()!r})")
            return EXIT_USAGE
        script = spec.origin
    why = not_a_file(script)  # (a device, a loop of links, an unreadable file: named as what it is)
    folder = why == "is a folder" and ns.module is None and os.path.isfile(os.path.join(script, "__main__.py"))
    if folder:
        why = None  # (as python runs it: its __main__.py, the folder first on sys.path)
    if why is not None:
        _err(f"{script!r} is a folder, not a script (give the .py file the folder's training starts from)"
             if why == "is a folder" else f"no such script: {script!r}" if why == "does not exist"
             else f"the script {script!r} {why}")
        return EXIT_USAGE
    if ns.module is None and script.lower().endswith(".ipynb"):  # (JSON that python runs as a dict literal, or fails on `null`)
        _err(f"{script!r} is a Jupyter notebook, not a Python script: export it (jupyter nbconvert --to script "
             f"{os.path.basename(script)}) and run the .py, or call nanhunt.watch(model, optimizer=opt) in the notebook")
        return EXIT_USAGE
    report_path = None
    if ns.report:
        report_path = rank_path(ns.report)
        if os.path.splitext(report_path)[1].lower() not in (".json", ".html", ".txt"):
            _err(f"--report must end in .json, .html or .txt; got {ns.report!r}")
            return EXIT_USAGE
        from .._files import check_writable

        try:  # as the OS resolves it ("missing/../r.json" names no folder), kept absolute
            report_path = check_writable(report_path, (".json", ".html", ".txt"), "--report")
        except (ValueError, PermissionError) as e:
            _err(str(e))
            return EXIT_USAGE
    if ns.history < 0:
        _err("--history must be >= 0")
        return EXIT_USAGE
    from .._record.options import MAX_DIST_TIMEOUT

    if not 0 < ns.dist_timeout <= MAX_DIST_TIMEOUT:  # inf, nan: refused here, not at the first collective
        _err(f"--dist-timeout must be > 0 and <= {MAX_DIST_TIMEOUT:g} seconds (a year); got {ns.dist_timeout:g}")
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

    bundle_was = _stamp(extra.get("bundle"))
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [script, *ns.args]
    here = os.getcwd() if ns.module is not None else os.path.realpath(script) if folder else \
        os.path.dirname(os.path.realpath(script))
    if sys.path:
        sys.path[0] = here  # as `python script.py` sets it (a link to the script: the folder it points into)
    else:
        sys.path.insert(0, here)
    code = 0
    raised: NonFiniteError | None = None
    options = {"on_find": "breakpoint" if ns.pdb else ns.on_find, "mode": ns.mode, "history": ns.history,
               "dist_timeout": ns.dist_timeout}
    # (the report at the first finding too; under torchrun only rank 0 writes it, at the end, with every rank's)
    auto = AutoWatch(**options, **extra, report=None if os.environ.get("RANK") else report_path)
    spawned = _Spawned(options, auto)
    try:
        # (an absolute path, as `python script.py` gives ``__file__`` since 3.9: a script that
        # changes directory and reads a file beside itself still finds it)
        if ns.module is not None:  # (its package imported first, __spec__ and relative imports as python -m gives them)
            runpy.run_module(ns.module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(os.path.abspath(script), run_name="__main__")
    except NonFiniteError as e:
        raised = e
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt as e:
        _script_traceback(e)
        code = 130
    except BaseException as e:
        _script_traceback(e)
        code = 1
    finally:
        try:
            auto.close(leaving=code != EXIT_CLEAN)  # (the script raised or exited non-zero)
        finally:
            spawned.close()
            sys.argv = saved_argv
            sys.path[:] = saved_path
    report = spawned.report(auto.report())
    unbundled = _bundle_left_to_script(auto, extra.get("bundle"), bundle_was)
    if not report.findings and raised is not None:  # the script's own nanhunt.watch raised
        report = raised.report if raised.report is not None else type(report)([raised.finding])
    report, group = _merge_ranks(report, ns.dist_timeout)
    if group is not None and ns.report:
        report_path = ns.report  # one report, every rank's findings, written by rank 0
    lead = group is None or group.rank == 0
    if report_path is not None and lead:
        try:
            report.save(report_path)
        except OSError as e:
            _err(f"cannot write the report to {report_path!r}: {e}")
            report_path = None  # (not said to be written below)
    if report.findings:
        code = EXIT_FOUND
        if lead:
            print("", file=sys.stderr)
            print_report(report, sys.stderr)
            if report_path is not None:
                print(f"\nnanhunt: report written to {report_path}", file=sys.stderr)
            if unbundled is not None:
                _err(unbundled)
        elif group is not None:
            _err(f"rank {group.rank}: NaN/Inf found (first on rank {report.findings[0].rank}); rank 0 has the report")
    elif code != EXIT_CLEAN:  # (a script's own sys.exit(3) or sys.exit(2) is no finding and no usage error)
        _err(f"no NaN/Inf found; exit status {code} is the script's own")
    if group is not None:
        sys.stderr.flush()
        sys.stdout.flush()
        try:  # nobody leaves before rank 0 has written: torchrun stops the others once one exits non-zero
            group.barrier()
        except Exception as e:
            _err(str(e))
        group.close()
    return code


class _Spawned:
    """The processes a script starts to train in (a script's own multi-process training without
    torchrun) are watched as the script is: ``torch.multiprocessing.spawn``/``start_processes``, and
    a ``multiprocessing.Process`` (of any start method) whose target is the script's own function.
    While `nanhunt run` runs the script, each one's function runs under an `AutoWatch` of its own (a
    forked one goes on with the watch it inherited; a finding raises there as it would in the
    script), and leaves its findings in a folder for `report`. A library's processes (a
    DataLoader's workers, a Pool's, torch's own wrapper of a spawned function) are left alone."""

    def __init__(self, options: dict[str, Any], auto: Any) -> None:
        from multiprocessing import process

        spawn: Any = importlib.import_module("torch.multiprocessing.spawn")  # (the module, not the function)
        if options["on_find"] == "breakpoint":  # (no terminal in there: --pdb's stop is a raise)
            options = {**options, "on_find": "raise"}
        self.folder = folder = tempfile.mkdtemp(prefix="nanhunt-spawned-")
        self.module, self.original = spawn, spawn.start_processes
        self.process, self.start = process.BaseProcess, process.BaseProcess.start
        original, start, count = spawn.start_processes, process.BaseProcess.start, itertools.count()
        global _RUNNING
        _RUNNING = auto

        @functools.wraps(original)
        def start_processes(fn: Any, *args: Any, **kwargs: Any) -> Any:
            return original(functools.partial(_watched_process, fn, options, folder), *args, **kwargs)

        @functools.wraps(start)
        def start_process(proc: Any) -> None:
            target = getattr(proc, "_target", None)
            if not _scripts_own(target):
                return start(proc)
            # the child gets the wrapped target (pickled, or copied by the fork), the script's own
            # object keeps its own
            proc._target = functools.partial(_watched_target, target, options, folder, next(count))
            try:
                return start(proc)
            finally:
                proc._target = target

        spawn.start_processes = start_processes  # (what torch.multiprocessing.spawn calls)
        self.process.start = start_process  # type: ignore[method-assign, assignment]

    def close(self) -> None:
        global _RUNNING
        _RUNNING = None
        self.module.start_processes = self.original
        self.process.start = self.start  # type: ignore[method-assign]

    def report(self, own: Any) -> Any:
        """``own`` with every started process' findings (in the order `_dist.merge` gives them)."""
        from .._record import dist as _dist
        from .._report import Report

        def order(name: str) -> tuple[str, int]:
            kind, _, i = name.partition(".")[0].partition("-")
            return kind, int(i)

        try:  # (a process stopped while writing leaves only a temporary file of atomic_write's: not read)
            names = sorted((n for n in os.listdir(self.folder) if _CHILD_FILE.fullmatch(n)), key=order)
            theirs = []
            for name in names:
                try:
                    with open(os.path.join(self.folder, name), encoding="utf-8") as fh:
                        theirs.append(json.load(fh))
                except (OSError, ValueError) as e:
                    _err(f"the findings of a started process ({name}) could not be read: {_one_line(e)}")
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
        if not any(theirs):
            return own
        found = _dist.merge([[f.to_dict() for f in own.findings], *theirs])
        return Report(found, history=own.history, warnings=own.warnings, meta=own.meta)


_CHILD_FILE = re.compile(r"(spawn|process)-[0-9]+\.json")  # what `_watched` leaves for `_Spawned.report`
_RUNNING: Any = None  # the script's AutoWatch while `nanhunt run` runs it (a forked process inherits it)
_LIBRARIES = ("torch", "multiprocessing", "concurrent", "nanhunt", "accelerate", "lightning", "pytorch_lightning")


def _scripts_own(target: Any) -> bool:
    """Is a process' target the script's own function (not a library's worker loop)?"""
    while isinstance(target, functools.partial):
        target = target.func
    if target is None:
        return False
    mod = getattr(target, "__module__", None) or ""
    return mod.partition(".")[0] not in _LIBRARIES


def _watched_process(fn: Any, options: dict[str, Any], folder: str, i: int, *args: Any) -> Any:
    """Process ``i`` of a spawn under `nanhunt run` (see `_Spawned`): ``fn(i, *args)`` watched."""
    return _watched(os.path.join(folder, f"spawn-{i}.json"), options, functools.partial(fn, i, *args))


def _watched_target(target: Any, options: dict[str, Any], folder: str, n: int, *args: Any, **kwargs: Any) -> Any:
    """The ``n``-th ``multiprocessing.Process`` the script started (see `_Spawned`): its target watched."""
    return _watched(os.path.join(folder, f"process-{n}.json"), options, functools.partial(target, *args, **kwargs))


def _watched(path: str, options: dict[str, Any], run: Any) -> Any:
    """``run()`` in a started process, watched; its findings left at ``path`` for the script's run."""
    from .auto import AutoWatch

    inherited = _RUNNING  # (forked: the script's watch, with its patches, goes on in here)
    auto = inherited if inherited is not None else AutoWatch(**options)
    before = len(auto.findings())
    leaving = True
    try:
        out = run()
        leaving = False
        return out
    finally:
        if inherited is None:
            auto.close(leaving=leaving)
        found = [f.to_dict() for f in auto.findings()[before:]]
        if found:  # (atomically: a process stopped while writing, by a second Ctrl-C, leaves no half file)
            from .._files import atomic_write

            atomic_write(path, ".json", lambda tmp: _dump(found, tmp))


def _dump(data: Any, path: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh)


def _script_traceback(e: BaseException) -> None:
    """``e`` on stderr as `python script.py` shows it: from the script's own frames on, without
    nanhunt's and runpy's that ran it (a syntax error in the script: its line alone)."""
    tb = e.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__)
                              or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb)


def _stamp(path: str | None) -> tuple[int, int] | None:
    try:
        st = os.stat(path) if path else None
    except OSError:
        return None
    return None if st is None else (st.st_mtime_ns, st.st_ino)


def _bundle_left_to_script(auto: Any, bundle: str | None, was: tuple[int, int] | None) -> str | None:
    """Why ``--bundle`` was not written, when the first finding is one of the script's own hunts'
    (a model the script watches itself is left to its hunt, which saves a bundle only with its
    own ``bundle=``); else None. ``was``: the file's `_stamp` before the run (an old bundle there
    is not this run's)."""
    if bundle is None or (os.path.exists(bundle) and _stamp(bundle) != was):
        return None
    merged = auto._merged()
    if not merged or not any(merged[0][0] is h for h in auto.script_hunts):
        return None
    return (f"no repro bundle written to {bundle}: the first finding was made by the script's own "
            "nanhunt.watch, which saves one only when given bundle= itself")


def _merge_ranks(report: Any, timeout: float) -> tuple[Any, Any]:
    """Under torch.distributed (torchrun): every rank's findings, merged in one order on every rank,
    over a gloo group of nanhunt's own (every rank ends its run here, whatever the script did). When the
    script destroyed its process group, or a rank does not come: this rank's own report, as before."""
    from .._record import dist as _dist
    from .._report import Report

    if _dist.world() < 2:
        return report, None
    group = _dist.Group(timeout)
    try:
        everyone = group.gather([f.to_dict() for f in report.findings])
    except Exception as e:
        _err(str(e))
        group.close()
        return report, None
    merged = Report(_dist.merge(everyone), history=report.history, warnings=report.warnings, meta=report.meta)
    return merged, group
