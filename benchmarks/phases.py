"""Instructions per phase of a training step (callgrind): where a variant's extra instructions go.

Like `instructions.py`, but with a marker (``os.getppid()``, which callgrind dumps before) at each
phase boundary of the step: the root's hooks, the model's forward (from its first child's
pre-hook to its last child's hook), the loss code, ``hunt.check``, backward, the optimizer's
pre-hooks, its update (from a step pre-hook registered last to a step post-hook moved first), its
post-hooks, ``zero_grad``. Each phase's count is exact; the difference from plain's same phase is
what the variant adds there. ``--split`` adds markers around functions (``module:Class.method`` or
``module:function``, looked up in that module's namespace, so a function another module imported
by name is split where that module calls it) to see inside a phase.

    python benchmarks/phases.py                                     # mlp: plain,sentinel (~3 min)
    python benchmarks/phases.py --variants plain,full --split nanhunt._record.probe:_run

The model's forward here begins at its first child: what a variant's root pre-hook does shows as
``root_pre``, its root post-hook together with the loss code as ``root_post`` (full mode's global
hooks on the first and last child land next to the markers, on either side). Warmed up 12 steps
(sentinel's every-10th-step probe has run once), then ``--steps`` steps.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import OrderedDict
from typing import Any

PHASES = ("root_pre", "fwd", "root_post", "check", "backward", "pre_step", "update", "post_step",
          "zero_grad", "rest")


def _child(model: str, variants: list[str], steps: int, splits: list[str], names_file: str) -> None:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import overhead

    torch.set_num_threads(1)
    bench = overhead.build(model)
    m, opt = bench.model, bench.opt
    names: list[str] = []
    on = [False]

    def mark(name: str) -> None:
        names.append(name if on[0] else "-")
        os.getppid()

    for spec in splits:
        mod_name, _, attr = spec.partition(":")
        owner: Any = importlib.import_module(mod_name)
        *path, last = attr.split(".")
        for p in path:
            owner = getattr(owner, p)
        f = getattr(owner, last)

        def wrapped(*a: Any, _f: Any = f, _label: str = attr, **k: Any) -> Any:
            mark(_label)
            try:
                return _f(*a, **k)
            finally:
                mark(_label + " (after)")

        setattr(owner, last, wrapped)

    children = list(m.children())
    for _ in range(2):
        bench.step()
    for v in variants:
        with overhead.variant(v.rstrip("0123456789"), bench) as hunt:
            hs = [children[0].register_forward_pre_hook(lambda *a: mark("fwd")),
                  children[-1].register_forward_hook(lambda *a: mark("root_post")),
                  opt.register_step_pre_hook(lambda *a: mark("update")),
                  opt.register_step_post_hook(lambda *a: mark("post_step"))]
            opt._optimizer_step_post_hooks.move_to_end(hs[-1].id, last=False)

            def step() -> None:
                mark("root_pre")
                loss = bench.loss_fn(m, bench.batch)
                mark("check")
                if hunt is not None:
                    hunt.check(loss, "loss")
                mark("backward")
                loss.backward()
                mark("pre_step")
                opt.step()
                mark("zero_grad")
                opt.zero_grad()
                mark("rest")

            for _ in range(12):
                step()
            on[0] = True
            mark("BLOCK:" + v)
            for _ in range(steps):
                step()
            mark("END")
            on[0] = False
            for h in hs:
                h.remove()
    with open(names_file, "w") as f:
        json.dump(names, f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--variants", default="plain,sentinel", help="the first is the baseline")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--split", default="", help="comma-separated module:function to mark around")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    splits = [s for s in args.split.split(",") if s]
    if args.child:
        _child(args.model, variants, args.steps, splits, args.child)
        return 0
    with tempfile.TemporaryDirectory() as out_dir:
        names_file = os.path.join(out_dir, "names.json")
        cmd = ["valgrind", "--tool=callgrind", "--dump-before=getppid",
               f"--callgrind-out-file={out_dir}/cg.out.%p", sys.executable, os.path.abspath(__file__),
               "--model", args.model, "--variants", args.variants, "--steps", str(args.steps),
               "--split", args.split, "--child", names_file]
        try:
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except FileNotFoundError:
            raise SystemExit("valgrind is not installed") from None

        def order(path: str) -> list[int]:
            return [int(x) for x in re.findall(r"\d+", os.path.basename(path))]

        totals = []
        for path in sorted(glob.glob(os.path.join(out_dir, "cg.out*")), key=order):
            with open(path) as f:
                totals.append(next(int(line.split()[1]) for line in f if line.startswith(("summary:", "totals:"))))
        with open(names_file) as f:
            names = json.load(f)
    # one dump at each marker (what ran since the one before), after `start` dumps of the
    # interpreter's start-up: the segment that begins at marker k is the dump at marker k + 1
    start = len(totals) - len(names)
    res: dict[str, OrderedDict[str, float]] = {}
    cur: OrderedDict[str, float] | None = None
    for k, name in enumerate(names):
        if name.startswith("BLOCK:"):
            cur = res.setdefault(name[6:], OrderedDict((p, 0.0) for p in PHASES))
        elif name == "END":
            cur = None
        elif name != "-" and cur is not None and k + start + 1 < len(totals):
            cur[name] = cur.get(name, 0.0) + totals[k + start + 1] / args.steps
    print(f"## {args.model}: instructions per step by phase (callgrind, {args.steps} steps; K = 1,000)")
    print(f"{'phase':28}" + "".join(f"{v:>12}" for v in variants) + "".join(f"{'+' + v:>12}" for v in variants[1:]))
    keys = list(OrderedDict.fromkeys(k for v in variants for k in res.get(v, {})))
    for key in keys:
        row = [res.get(v, {}).get(key, 0.0) for v in variants]
        print(f"{key:28}" + "".join(f"{x / 1e3:11.1f}K" for x in row)
              + "".join(f"{(x - row[0]) / 1e3:+11.1f}K" for x in row[1:]))
    sums = [sum(res.get(v, {}).values()) for v in variants]
    print(f"{'total':28}" + "".join(f"{x / 1e6:11.3f}M" for x in sums)
          + "".join(f"{'x%.3f' % (x / sums[0]):>12}" for x in sums[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
