"""Instructions per training step under valgrind's callgrind: exact and repeatable, for a machine
too noisy to time (timed ratios on a shared 2-core VM move by tens of points between runs).

Each variant of `overhead.py` is switched on, warmed up 3 steps, then `--steps` steps run between
two `os.getppid()` calls; callgrind dumps its counters before each (`--dump-before=getppid`), so
each block's count is exact. Cache misses are not counted: a variant that holds more memory may
time worse than its count says.

    python benchmarks/instructions.py                      # mlp: plain,full,sentinel,naive,hooks (~5 min)
    python benchmarks/instructions.py --model cnn --variants plain,full --steps 2
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile


def _child(model: str, variants: list[str], steps: int) -> None:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import overhead

    torch.set_num_threads(1)
    bench = overhead.build(model)
    for _ in range(2):
        bench.step()
    for v in variants:
        with overhead.variant(v, bench) as hunt:
            for _ in range(3):
                bench.step(hunt)
            os.getppid()  # dump: everything before the block
            for _ in range(steps):
                bench.step(hunt)
            os.getppid()  # dump: the block


def _totals(out_dir: str) -> list[int]:
    def order(path: str) -> list[int]:
        return [int(x) for x in re.findall(r"\d+", os.path.basename(path))]

    totals = []
    for path in sorted(glob.glob(os.path.join(out_dir, "cg.out*")), key=order):
        with open(path) as f:
            for line in f:
                if line.startswith(("summary:", "totals:")):
                    totals.append(int(line.split()[1]))
                    break
    return totals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--variants", default="plain,full,sentinel,naive,hooks")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if args.child:
        _child(args.model, variants, args.steps)
        return 0
    if "plain" not in variants:
        variants.insert(0, "plain")
    with tempfile.TemporaryDirectory() as out_dir:
        cmd = ["valgrind", "--tool=callgrind", "--dump-before=getppid",
               f"--callgrind-out-file={out_dir}/cg.out.%p", sys.executable, os.path.abspath(__file__),
               "--child", "--model", args.model, "--variants", ",".join(variants), "--steps", str(args.steps)]
        try:
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except FileNotFoundError:
            raise SystemExit("valgrind is not installed") from None
        totals = _totals(out_dir)[1:]  # the first dump: start-up and the model's build
    per_step = {v: totals[2 * i + 1] / args.steps for i, v in enumerate(variants) if 2 * i + 1 < len(totals)}
    plain = per_step["plain"]
    print(f"## {args.model}: instructions per training step (callgrind, {args.steps} steps per variant)")
    for v, n in per_step.items():
        print(f"{v:9} {n / 1e6:8.2f} M  x{n / plain:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
