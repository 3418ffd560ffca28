"""Python bytecodes nanhunt runs per training step, by function and by line: exact, repeatable,
and seconds to take (callgrind's `instructions.py` takes minutes and counts torch's C++ too).

A `sys.settrace` tracer with ``f_trace_opcodes`` counts every bytecode executed in a frame of
nanhunt's own code during ``--steps`` steps (after 11 warm-up steps, so that sentinel's
every-10th-step probe is inside the window once in ten). The torch calls nanhunt makes are one
bytecode each here: their cost is in `instructions.py`. Use it to see which Python function of the
hot path pays per module call (calls per step ~ the model's module calls) and which per step.

    python benchmarks/opcodes.py                        # mlp, full and sentinel (~10 s)
    python benchmarks/opcodes.py --variants full --lines _record/hunt.py:_flush,_record/forwards.py:__call__
"""

from __future__ import annotations

import argparse
import collections
import linecache
import os
import sys
from typing import Any


def count(model: str, variant: str, steps: int, lines: set[str]) -> tuple[collections.Counter[Any], ...]:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import overhead

    import nanhunt

    root = os.path.dirname(os.path.abspath(nanhunt.__file__)) + os.sep
    torch.set_num_threads(1)
    bench = overhead.build(model)
    for _ in range(2):
        bench.step()
    ops: collections.Counter[Any] = collections.Counter()
    calls: collections.Counter[Any] = collections.Counter()
    by_line: collections.Counter[Any] = collections.Counter()

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        code = frame.f_code
        if not code.co_filename.startswith(root):
            return None
        key = (code.co_filename[len(root):], code.co_name)
        calls[key] += 1
        frame.f_trace_opcodes = True
        per_line = f"{key[0]}:{key[1]}" in lines

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "opcode":
                ops[key] += 1
                if per_line:
                    by_line[(code.co_filename, frame.f_lineno or 0)] += 1  # (None: no line, a jump's)
            return local
        return local

    with overhead.variant(variant, bench) as hunt:
        for _ in range(11):
            bench.step(hunt)
        sys.settrace(tracer)
        try:
            for _ in range(steps):
                bench.step(hunt)
        finally:
            sys.settrace(None)
    return ops, calls, by_line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--variants", default="full,sentinel")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=20, help="functions shown per variant")
    ap.add_argument("--lines", default="", help="file:function as listed (_record/hunt.py:_flush) to break down by line, comma-separated")
    args = ap.parse_args(argv)
    lines = {x for x in args.lines.split(",") if x}
    for v in [v for v in args.variants.split(",") if v]:
        ops, calls, by_line = count(args.model, v, args.steps, lines)
        n = args.steps
        print(f"## {args.model}, {v}: {sum(ops.values()) / n:,.0f} bytecodes of nanhunt per step ({n} steps)")
        print(f"{'bytecodes/step':>15} {'calls/step':>11}  function")
        for key, k in ops.most_common(args.top):
            print(f"{k / n:15,.0f} {calls[key] / n:11.1f}  {key[0]}:{key[1]}")
        if by_line:
            print(f"{'bytecodes/step':>15}  line")
            for (f, ln), k in by_line.most_common(args.top):
                print(f"{k / n:15,.0f}  {os.path.basename(f)}:{ln}  {linecache.getline(f, ln).strip()[:100]}")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
