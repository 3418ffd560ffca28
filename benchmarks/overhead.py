"""Overhead of nanhunt against plain PyTorch and the tools people reach for instead (issue 4).

Three models, each trained with forward + backward + AdamW step + zero_grad:

  gpt2  GPT-2 from a transformers config: 6 layers, n_embd 384, 6 heads, vocab 4096, 8 x 128 tokens
  cnn   8 x (conv3x3 + BatchNorm + ReLU), 4 max-pools, 16 x 3 x 64 x 64, linear head, cross-entropy
  mlp   24 x (Linear 64 + LayerNorm + GELU) + linear head, batch 32, MSE  (hook-overhead bound)

Variants share one model and optimizer and are interleaved: for each round, for each variant (the
order rotates every round), the variant is switched on, warmed up, and `k` steps are timed. So
machine noise is shared, and a ratio is the median per-step time of a variant over plain's.

  plain      no instrumentation
  full       nanhunt.watch(model, optimizer=opt, on_find="record")    (+ hunt.check(loss))
  sentinel   the same with mode="sentinel"
  ops        the same with mode="ops" (every aten op probed: a debugging setting; step time only)
  naive      the article's forward hook on every module: isnan(out).any() or isinf(out).any()
  hooks      two global hooks that do nothing (a pre-hook and an always-called forward hook with
             kwargs, as full mode registers): the floor of any per-module-hook design
  wrap       each module's forward replaced by a wrapper that keeps its output (with its version),
             all outputs summed together per shape at the loss (one stack + sum each): the floor
             of a design that sees every call without module hooks (not a locator: no records)
  anomaly    torch.autograd.detect_anomaly(check_nan=True)
  hf         transformers.debug_utils.DebugUnderflowOverflow(model)

Also measured, for the nanhunt settings: host syncs added per step (calls of Tensor.item, bool,
tolist, float, int counted by patching them; plain's own count, e.g. AdamW's, is subtracted), peak
memory (CPU: peak RSS growth of a fresh subprocess per variant; CUDA: max_memory_allocated), bytes
of tensors nanhunt keeps alive between steps, registration time of watch() + close() on a model of
1,001 modules, and the time of a step in which a NaN is planted (analysis and replay included)
measured in plain steps.

    python benchmarks/overhead.py                    # all three models, ~6 min on 2 CPU cores
    python benchmarks/overhead.py --quick --models mlp
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import io
import json
import logging
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nanhunt

MODELS = ("gpt2", "cnn", "mlp")
VARIANTS = ("plain", "full", "sentinel", "ops", "naive", "hooks", "wrap", "anomaly", "hf")
NANHUNT = ("full", "sentinel")
TITLES = {
    "plain": "plain ms/step",
    "full": "nanhunt full",
    "sentinel": "nanhunt sentinel",
    "ops": "nanhunt ops",
    "naive": "naive hook",
    "hooks": "2 empty hooks",
    "wrap": "forward wrappers",
    "anomaly": "detect_anomaly",
    "hf": "HF DebugUO",
}
TARGETS = {"gpt2": 1.05, "cnn": 1.05, "mlp": 1.15}
SENTINEL_TARGETS = {"gpt2": 1.01, "cnn": 1.01, "mlp": 1.03}  # (the MLP is hook-bound: 98 calls in a few ms)
# (steps timed per block, rounds) by default and with --quick
STEPS = {"gpt2": 2, "cnn": 5, "mlp": 30}
QUICK_STEPS = {"gpt2": 1, "cnn": 2, "mlp": 10}
ROUNDS = {"gpt2": 7, "cnn": 9, "mlp": 15}
SYNC_METHODS = ("item", "__bool__", "tolist", "__float__", "__int__")
_MISSING = object()


# --------------------------------------------------------------------------- models
class Bench:
    """A model, its optimizer and one fixed batch; ``step()`` is one training step."""

    def __init__(self, name: str, model: nn.Module, batch: tuple[Any, ...],
                 loss: Callable[[nn.Module, tuple[Any, ...]], torch.Tensor], plant: str, device: str):
        self.name = name
        self.model = model.to(device).train()
        self.batch = tuple(b.to(device) for b in batch)
        self.loss_fn = loss
        self.plant = plant  # a submodule where a NaN is planted for the hit measurement
        self.device = device
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self, hunt: Any = None) -> None:
        loss = self.loss_fn(self.model, self.batch)
        if hunt is not None:
            hunt.check(loss, "loss")
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()


def build(name: str, device: str = "cpu") -> Bench:
    torch.manual_seed(0)
    if name == "gpt2":
        import transformers
        from transformers import GPT2Config, GPT2LMHeadModel

        transformers.logging.set_verbosity_error()
        cfg = GPT2Config(n_layer=6, n_embd=384, n_head=6, vocab_size=4096, n_positions=128,
                         bos_token_id=0, eos_token_id=0)
        ids = torch.randint(0, 4096, (8, 128))
        return Bench(name, GPT2LMHeadModel(cfg), (ids,),
                     lambda m, b: m(input_ids=b[0], labels=b[0]).loss, "transformer.h.2.mlp", device)
    if name == "cnn":
        chans = [3, 32, 32, 64, 64, 128, 128, 128, 128]
        layers: list[nn.Module] = []
        for i in range(8):
            layers += [nn.Conv2d(chans[i], chans[i + 1], 3, padding=1, bias=False),
                       nn.BatchNorm2d(chans[i + 1]), nn.ReLU(inplace=True)]
            if i % 2 == 1:
                layers.append(nn.MaxPool2d(2))
        model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(128 * 4 * 4, 10))
        x, y = torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))
        return Bench(name, model, (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]), "12", device)
    if name == "mlp":
        blocks = [nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()) for _ in range(24)]
        model = nn.Sequential(*blocks, nn.Linear(64, 64))
        x, y = torch.randn(32, 64), torch.randn(32, 64)
        return Bench(name, model, (x, y), lambda m, b: F.mse_loss(m(b[0]), b[1]), "12.0", device)
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


# --------------------------------------------------------------------------- variants
def _naive_hook(module: nn.Module, inputs: Any, output: Any) -> None:
    """The article's hook (seed/article-first-nan-forward-hook), raising on the first hit."""
    if isinstance(output, torch.Tensor):
        if torch.isnan(output).any() or torch.isinf(output).any():
            raise RuntimeError(f"NaN/Inf detected in {module.__class__.__name__} at {id(module)}")
    elif isinstance(output, (tuple, list)):
        for i, out in enumerate(output):
            if isinstance(out, torch.Tensor) and (torch.isnan(out).any() or torch.isinf(out).any()):
                raise RuntimeError(f"NaN/Inf detected in {module.__class__.__name__}[{i}]")


class _WrapperFloor:
    """The `wrap` variant: every module's ``forward`` an instance attribute that keeps the output
    and its version (no hook: each call stays on ``Module._call_impl``'s fast path); ``check`` (at
    the loss, where the benchmark calls ``hunt.check``) sums the kept outputs, one stack per shape,
    into one device flag. What any design that sees every call this way pays at least."""

    def __init__(self, model: nn.Module) -> None:
        self.outs: list[tuple[torch.Tensor, int]] = []
        self.flag: torch.Tensor | None = None
        self.modules = list(model.modules())
        keep = self.outs.append
        for m in self.modules:
            def forward(*args: Any, _f: Any = m.forward, **kwargs: Any) -> Any:
                out = _f(*args, **kwargs)
                if type(out) is torch.Tensor:
                    keep((out, out._version))
                return out

            m.forward = forward  # type: ignore[method-assign]

    def check(self, tensor: torch.Tensor, name: str = "check") -> torch.Tensor:
        with torch.no_grad():
            groups: dict[Any, list[torch.Tensor]] = {}
            for t, _ in self.outs:
                groups.setdefault((t.shape, t.dtype), []).append(t)
            sums = [torch.stack(g).sum() if len(g) > 1 else g[0].sum() for g in groups.values()]
            sums.append(tensor.detach().sum())
            self.flag = torch.stack(sums).sum()
        self.outs.clear()
        return tensor

    def remove(self) -> None:
        for m in self.modules:
            m.__dict__.pop("forward", None)


@contextlib.contextmanager
def variant(name: str, bench: Bench, on_find: str = "record") -> Iterator[Any]:
    """Switch a variant on for the duration of the block; yields the hunt (or None)."""
    model, opt = bench.model, bench.opt
    if name == "plain":
        yield None
    elif name in NANHUNT:
        hunt = nanhunt.watch(model, optimizer=opt, on_find=on_find, mode=name)
        try:
            yield hunt
        finally:
            hunt.close()
    elif name == "ops":  # every aten op checked from the start: a debugging setting, for its cost only
        hunt = nanhunt.watch(model, optimizer=opt, on_find=on_find, mode="ops")
        try:
            yield hunt
        finally:
            hunt.close()
    elif name == "naive":
        handles = [m.register_forward_hook(_naive_hook) for m in model.modules()]
        try:
            yield None
        finally:
            for h in handles:
                h.remove()
    elif name == "hooks":
        from torch.nn.modules import module as module_mod

        def nothing(*args: Any, **kwargs: Any) -> None:
            return None

        pre = module_mod.register_module_forward_pre_hook(nothing)
        post = module_mod.register_module_forward_hook(nothing, with_kwargs=True, always_call=True)
        try:
            yield None
        finally:
            pre.remove()
            post.remove()
            module_mod._global_forward_hooks_with_kwargs.pop(post.id, None)
    elif name == "wrap":
        floor = _WrapperFloor(model)
        try:
            yield floor
        finally:
            floor.remove()
    elif name == "anomaly":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Anomaly Detection has been enabled ..."
            with torch.autograd.detect_anomaly(check_nan=True):
                yield None
    elif name == "hf":
        from transformers.debug_utils import DebugUnderflowOverflow

        debug = DebugUnderflowOverflow(model)  # registers a forward hook on every module, no handles
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # it prints its frames on detection
                yield None
        finally:
            for m in model.modules():
                for k, fn in list(m._forward_hooks.items()):
                    if getattr(fn, "__self__", None) is debug:
                        del m._forward_hooks[k]
    else:
        raise SystemExit(f"unknown variant {name!r}")


# --------------------------------------------------------------------------- timing
def time_variants(bench: Bench, variants: list[str], rounds: int, k: int, warmup: int = 1) -> dict[str, list[float]]:
    """Per-step seconds of each block, interleaved; the variant order rotates every round."""
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            with variant(v, bench) as hunt:
                for _ in range(warmup):
                    bench.step(hunt)
                bench.sync()
                t0 = time.perf_counter()
                for _ in range(k):
                    bench.step(hunt)
                bench.sync()
                times[v].append((time.perf_counter() - t0) / k)
    return times


# --------------------------------------------------------------------------- syncs
@contextlib.contextmanager
def count_syncs() -> Iterator[dict[str, int]]:
    """Count calls of the Tensor methods that read a value back to the host."""
    counts = {m: 0 for m in SYNC_METHODS}
    saved = {m: torch.Tensor.__dict__.get(m, _MISSING) for m in SYNC_METHODS}

    def wrap(name: str, fn: Any) -> Any:
        def counted(self: torch.Tensor, *a: Any, **kw: Any) -> Any:
            counts[name] += 1
            return fn(self, *a, **kw)

        return counted

    for m in SYNC_METHODS:
        setattr(torch.Tensor, m, wrap(m, getattr(torch.Tensor, m)))
    try:
        yield counts
    finally:
        for m, orig in saved.items():
            if orig is _MISSING:
                delattr(torch.Tensor, m)
            else:
                setattr(torch.Tensor, m, orig)


def syncs_per_step(bench: Bench, name: str, steps: int = 3) -> float:
    """Host reads per step, as a proxy for device syncs. On CPU, nanhunt judges the optimizer's
    update right after ``step()`` (`Hunt._judged_now`: a CPU tensor's read, nothing to wait for; on
    a GPU that probe is read at the next step's sync): that read is left out."""
    from nanhunt._record.hunt import Hunt

    orig = Hunt._judged_now
    cpu_reads = [0]

    def judged(self: Any, vec: Any) -> bool:
        before = sum(counts.values())
        try:
            return orig(self, vec)
        finally:
            cpu_reads[0] += min(sum(counts.values()) - before, 1)

    with variant(name, bench) as hunt:
        bench.step(hunt)  # warm: lazy setup is not a per-step cost
        with count_syncs() as counts:
            Hunt._judged_now = judged  # type: ignore[method-assign]
            try:
                for _ in range(steps):
                    bench.step(hunt)
            finally:
                Hunt._judged_now = orig  # type: ignore[method-assign]
    return (sum(counts.values()) - cpu_reads[0]) / steps


# --------------------------------------------------------------------------- memory
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    """This process's peak RSS. VmHWM, not ru_maxrss: ru_maxrss survives exec and so can hold the
    size of the parent that forked this process."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def measure_peak(model_name: str, name: str, device: str, steps: int = 4) -> float:
    """Bytes of peak training memory (model, optimizer state, activations, instrumentation).

    CPU: run in a fresh process (``--_mem``): peak RSS at the end minus RSS before the model is
    built. CUDA: max_memory_allocated over the steps, in this process."""
    if device.startswith("cuda"):
        bench = build(model_name, device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with variant(name, bench) as hunt:
            for _ in range(steps):
                bench.step(hunt)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del bench
        return float(peak)
    cmd = [sys.executable, os.path.abspath(__file__), "--_mem", model_name, name, "--device", device]
    # glibc's mmap threshold adapts to the allocation history, so whether a freed activation went
    # back to the OS or stayed in the heap varied between identical runs: the CNN's peak moved by
    # 25 MB (+/-10 %). A fixed threshold maps every tensor past 128 KiB on its own and returns it at
    # free: peak RSS is then the peak of what was alive, repeatable to ~0.3 MB.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True, env=env)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["peak"])


def _mem_child(model_name: str, name: str, device: str, steps: int = 4) -> None:
    torch.set_num_threads(2)
    if model_name == "gpt2":
        import transformers  # noqa: F401  (imports are not training memory)
    # nor are nanhunt's own modules, imported on first use by watch() (~10 MB of Python code and
    # torch submodules: they counted as +11 % of the MLP's 88 MB before the model was built)
    import nanhunt._record.hunt  # noqa: F401

    # and what watch() imports with them: the checkpoint guard imports safetensors when it is
    # installed, to guard its writers (~1 MB of code, counted as +1.3 % of the MLP's peak before)
    from nanhunt._record.guard import _safetensors

    _safetensors()
    base = _rss_bytes()
    bench = build(model_name, device)
    with variant(name, bench) as hunt:
        for _ in range(steps):
            bench.step(hunt)
    print(json.dumps({"peak": _peak_rss_bytes() - base}))


_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.CodeType)


def kept_bytes(bench: Bench) -> int:
    """Bytes of tensor storage reachable from an open hunt between steps, other than the model's
    parameters, gradients and optimizer state (which it references but does not own)."""
    with variant("full", bench) as hunt:
        for _ in range(2):
            bench.step(hunt)
        return held(hunt, bench.model, bench.opt, bench.batch)[0]


def held(hunt: Any, model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> tuple[int, int]:
    """(tensor bytes, Python objects) reachable from ``hunt`` now, not counting the model, its
    parameters, buffers, gradients and optimizer state (which it references but does not own)."""
    owned = set()
    for p in model.parameters():
        owned.add(p.untyped_storage().data_ptr())
    for b in model.buffers():
        owned.add(b.untyped_storage().data_ptr())
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                owned.add(v.untyped_storage().data_ptr())
    gc.collect()
    stop = {id(model), id(opt), id(batch), id(opt.state), id(opt.param_groups)} | {id(m) for m in model.modules()}
    stop |= {id(p) for p in model.parameters()} | {id(st) for st in opt.state.values()}
    seen: set[int] = set()
    stack: list[Any] = [hunt]
    total = 0
    objects = 0
    storages: set[int] = set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen or id(obj) in stop:
            continue
        seen.add(id(obj))
        objects += 1
        if isinstance(obj, torch.Tensor):
            s = obj.untyped_storage()
            if s.data_ptr() not in owned and s.data_ptr() not in storages:
                storages.add(s.data_ptr())
                total += s.nbytes()
            continue
        if isinstance(obj, _OPAQUE):  # code and globals, not data the hunt holds
            continue
        if isinstance(obj, types.MethodType):
            stack.append(obj.__self__)
            continue
        stack.extend(gc.get_referents(obj))
    return total, objects


# --------------------------------------------------------------------------- scale
SCALE = (10, 100, 1000, 10000)


def scale_row(n: int, rounds: int = 3, k: int = 2) -> dict[str, float]:
    """How cost grows with model size: ``nn.Sequential`` of ``n`` ``Linear(4, 4)`` (n + 1 module
    calls a step), SGD. Registration (watch + close), the first watched step's extra (the name
    map, built lazily), per-step overhead of full and sentinel over plain (interleaved, min of
    ``rounds`` blocks of ``k`` steps: the least disturbed), and what the hunt holds between steps."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(2, 4)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    reg = []
    for _ in range(5):
        t0 = time.perf_counter()
        nanhunt.watch(model, optimizer=opt).close()
        reg.append(time.perf_counter() - t0)
    times: dict[str, list[float]] = {"plain": [], "full": [], "sentinel": []}
    first: list[float] = []
    for r in range(rounds):
        for v in ("plain", "full", "sentinel")[r % 3:] + ("plain", "full", "sentinel")[:r % 3]:
            hunt = nanhunt.watch(model, optimizer=opt, on_find="record", mode=v) if v != "plain" else None
            t0 = time.perf_counter()
            step()  # the first step builds the name map
            if v == "full":
                first.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(k):
                step()
            times[v].append((time.perf_counter() - t0) / k)
            if hunt is not None:
                if v == "full" and r == 0:
                    kept, objects = held(hunt, model, opt, x)
                hunt.close()
    plain = min(times["plain"])
    return {
        "modules": n + 1, "register_ms": statistics.median(reg) * 1e3,
        "first_extra_ms": (min(first) - min(times["full"])) * 1e3, "plain_ms": plain * 1e3,
        "full_ms": (min(times["full"]) - plain) * 1e3, "sentinel_ms": (min(times["sentinel"]) - plain) * 1e3,
        "per_call_us": (min(times["full"]) - plain) / (n + 1) * 1e6,
        "kept_bytes": kept, "kept_objects": objects,
    }


def render_scale(rows: list[dict[str, float]]) -> str:
    head = ["modules", "watch+close ms", "1st step extra ms", "plain ms/step", "full +ms/step",
            "full us/call", "sentinel +ms/step", "kept between steps"]
    body = [[f"{r['modules']:,}", f"{r['register_ms']:.3f}", f"{r['first_extra_ms']:.1f}", f"{r['plain_ms']:.1f}",
             f"{r['full_ms']:.2f}", f"{r['per_call_us']:.1f}", f"{r['sentinel_ms']:.2f}",
             f"{r['kept_bytes'] / 2**10:.1f} KB, {r['kept_objects']:,} objects"] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    fmt = " | ".join(f"{{:>{w}}}" for w in widths)
    out = ["## Scale: nn.Sequential of Linear(4, 4), SGD (min of interleaved blocks)", fmt.format(*head),
           "-+-".join("-" * w for w in widths)]
    return "\n".join(out + [fmt.format(*b) for b in body])


# --------------------------------------------------------------------------- registration, hit
def registration_ms(n: int = 1000, repeats: int = 20) -> float:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])
    opt = torch.optim.AdamW(model.parameters())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        nanhunt.watch(model, optimizer=opt).close()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


@contextlib.contextmanager
def planted(module: nn.Module) -> Iterator[None]:
    """Make ``module``'s own forward put a NaN into the middle of its output (born there)."""
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        out = out.clone()
        out.view(-1)[out.numel() // 2] = float("nan")
        return out

    module.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.forward


def hit_seconds(bench: Bench, name: str, repeats: int = 3) -> tuple[float, str]:
    """Seconds of a step in which a NaN is born in ``bench.plant``'s output, until the error."""
    target = bench.model.get_submodule(bench.plant)
    times, where = [], "no finding"
    for _ in range(repeats):
        with variant(name, bench, on_find="raise") as hunt:
            bench.step(hunt)
            with planted(target):
                bench.sync()
                t0 = time.perf_counter()
                try:
                    bench.step(hunt)
                except nanhunt.NonFiniteError as e:
                    bench.sync()
                    times.append(time.perf_counter() - t0)
                    f = e.finding
                    where = f"{f.phase} {f.module or '<root>'} {f.tensor} ({f.cause})"
                else:
                    times.append(float("nan"))
                finally:
                    bench.opt.zero_grad()
    return statistics.median(times), where


# --------------------------------------------------------------------------- report
def _fmt_ratio(x: float) -> str:
    return f"x{x:.3f}" if x == x else "-"


def _mb(b: float) -> str:
    return f"{b / 2**20:.1f} MB"


def _progress(msg: str, t0: float) -> None:
    print(f"    {msg} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    variants = [v for v in VARIANTS if v not in args.skip.split(",")]
    if "hf" in variants:
        try:
            import transformers.debug_utils  # noqa: F401
        except ImportError:
            variants.remove("hf")
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads, nanhunt "
          f"{getattr(nanhunt, '__version__', '?')}, variants interleaved; ratio = median step time / plain's",
          flush=True)
    results: dict[str, Any] = {"models": {}, "device": args.device, "threads": torch.get_num_threads()}
    for name in models:
        t_start = time.perf_counter()
        k = (QUICK_STEPS if args.quick else STEPS)[name]
        rounds = args.rounds.get(name, args.rounds.get("*")) or (2 if args.quick else ROUNDS[name])
        res: dict[str, Any] = {}
        if not args.no_memory and (args.memory or not args.quick):
            res["peak"] = {v: measure_peak(name, v, args.device) for v in ("plain", *NANHUNT)}
            _progress(f"{name}: peak memory", t_start)
        bench = build(name, args.device)
        for _ in range(2):  # first steps allocate optimizer state and warm the kernels
            bench.step()
        times = time_variants(bench, variants, rounds, k)
        _progress(f"{name}: step times", t_start)
        med = {v: statistics.median(ts) for v, ts in times.items()}
        res["step_s"] = med
        res["ratio"] = {v: med[v] / med["plain"] for v in variants}
        res["paired"] = {
            v: sorted(a / b for a, b in zip(times[v], times["plain"])) for v in variants
        }
        res["syncs"] = {v: syncs_per_step(bench, v, 2 if args.quick else 3) for v in ("plain", *NANHUNT)}
        res["kept"] = kept_bytes(bench)
        _progress(f"{name}: syncs, kept bytes", t_start)
        res["hit"] = {}
        for v in NANHUNT:
            s, where = hit_seconds(bench, v, repeats=1 if args.quick else 3)
            res["hit"][v] = {"seconds": s, "steps": s / med["plain"], "finding": where}
            _progress(f"{name}: hit, {v}", t_start)
        res["rounds"], res["k"] = rounds, k
        res["wall_s"] = time.perf_counter() - t_start
        results["models"][name] = res
        print(f"  {name}: {rounds} rounds x {k} steps per variant, {res['wall_s']:.0f} s", flush=True)
        del bench
        gc.collect()
    results["registration_ms"] = registration_ms(repeats=5 if args.quick else 20)
    if args.scale:
        results["scale"] = []
        for n in (SCALE[:2] if args.quick else SCALE):
            t0 = time.perf_counter()
            results["scale"].append(scale_row(n, rounds=2 if args.quick else 3))
            _progress(f"scale: {n} modules", t0)
    return results


def render(results: dict[str, Any]) -> str:
    models = results["models"]
    variants = list(next(iter(models.values()))["ratio"]) if models else list(VARIANTS)
    lines = []
    head = ["model"] + [TITLES[v] for v in variants]
    rows = []
    for name, r in models.items():
        row = [name, f"{r['step_s']['plain'] * 1e3:.1f}"]
        for v in variants[1:]:
            p = r["paired"][v]
            q = f" [{p[len(p) // 4]:.2f}-{p[(3 * len(p)) // 4]:.2f}]" if v in NANHUNT and len(p) >= 4 else ""
            row.append(_fmt_ratio(r["ratio"][v]) + q)
        rows.append(row)
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    fmt = " | ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    lines.append("## Step time vs plain (median; [p25-p75] of per-round paired ratios)")
    lines.append(fmt.format(*head))
    lines.append("-+-".join("-" * w for w in widths))
    lines += [fmt.format(*row) for row in rows]

    lines.append("")
    lines.append("## nanhunt details")
    head2 = ["model", "setting", "syncs+/step", "peak mem (plain)", "peak +%", "kept between steps",
             "hit step", "finding"]
    rows2 = []
    for name, r in models.items():
        for v in NANHUNT:
            add = r["syncs"][v] - r["syncs"]["plain"]
            if "peak" in r:
                pk, pl = r["peak"][v], r["peak"]["plain"]
                mem, pct = f"{_mb(pk)} ({_mb(pl)})", f"{100 * (pk - pl) / pl:+.1f}%"
            else:
                mem, pct = "not measured", "-"
            h = r["hit"][v]
            rows2.append([name, v, f"{add:+.1f} ({r['syncs']['plain']:.0f} plain)", mem, pct,
                          _mb(r["kept"]) if v == "full" else "", f"{h['steps']:.1f} steps", h["finding"]])
    widths = [max(len(x) for x in col) for col in zip(head2, *rows2)]
    fmt = " | ".join(f"{{:<{w}}}" for w in widths)
    lines.append(fmt.format(*head2))
    lines.append("-+-".join("-" * w for w in widths))
    lines += [fmt.format(*row) for row in rows2]
    lines.append("")
    lines.append(f"registration: watch(model, optimizer=opt) + close() on 1,001 modules: "
                 f"{results['registration_ms']:.3f} ms (median)")
    if results["device"] == "cpu":
        lines.append("peak mem on CPU: peak RSS growth of a fresh process over 4 steps from before the model is "
                     "built (allocator granularity: ~1 MB noise); 'kept' = tensor bytes reachable from the open "
                     "hunt between steps, excluding parameters, grads and optimizer state.")

    lines.append("")
    lines.append("## Targets met?")
    for name, r in models.items():
        for v, target in (("full", TARGETS[name]), ("sentinel", SENTINEL_TARGETS[name])):
            x = r["ratio"][v]
            ok = x <= target
            lines.append(f"  {'yes' if ok else 'NO '}  {name:5} {v:8} x{x:.3f} (target <= {target:.2f}"
                         f"{'' if ok else f', over by {100 * (x - target):.1f} points'})")
        if "naive" in r["ratio"]:
            x, n = r["ratio"]["full"], r["ratio"]["naive"]
            lines.append(f"  {'yes' if x < n else 'NO '}  {name:5} full x{x:.3f} below the naive hook x{n:.3f}")
        worst = max(r["syncs"][v] - r["syncs"]["plain"] for v in NANHUNT)
        lines.append(f"  {'yes' if worst <= 1 else 'NO '}  {name:5} syncs added per step: {worst:+.1f} (target <= 1)")
        if "peak" in r:
            pl = r["peak"]["plain"]
            worst_pct = max(100 * (r["peak"][v] - pl) / pl for v in NANHUNT)
            lines.append(f"  {'yes' if worst_pct <= 5 else 'NO '}  {name:5} peak memory {worst_pct:+.1f}% (target <= +5%)")
        hit = max(r["hit"][v]["steps"] for v in NANHUNT)
        lines.append(f"  {'yes' if hit <= 3 else 'NO '}  {name:5} hit to full finding {hit:.1f} plain steps "
                     f"(target <= 3)")
    reg = results["registration_ms"]
    lines.append(f"  {'yes' if reg <= 3 else 'NO '}  registration {reg:.3f} ms on 1,001 modules (target <= 3 ms)")
    return "\n".join(lines)


def _rounds(text: str) -> dict[str, int]:
    """``--rounds``: ``20`` (every model) or ``gpt2=20,mlp=40``."""
    try:
        if "=" not in text:
            return {"*": int(text)}
        got = {m.strip(): int(n) for m, n in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"not N or model=N,...: {text!r}") from None
    bad = set(got) - set(MODELS)
    if bad:
        raise argparse.ArgumentTypeError(f"unknown model(s) {sorted(bad)}; known: {', '.join(MODELS)}")
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated: gpt2,cnn,mlp")
    default_rounds = ",".join(f"{m}={n}" for m, n in ROUNDS.items())
    ap.add_argument("--rounds", type=_rounds, default={},
                    help=f"interleaved rounds: N for every model, or per model as gpt2=20,mlp=40 (default: {default_rounds})")
    ap.add_argument("--quick", action="store_true", help="few rounds and steps: a smoke run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--skip", default="", help="comma-separated variants to leave out")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--memory", action="store_true", help="measure peak memory even with --quick")
    ap.add_argument("--scale", action="store_true", help="also the scale table (10 to 10,000 modules)")
    ap.add_argument("--scale-only", action="store_true", help="only the scale table")
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--_mem", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid> prints where a long run is
    if args._mem:
        _mem_child(args._mem[0], args._mem[1], args.device)
        return 0
    if args.scale_only:
        torch.set_num_threads(args.threads)
        rows = []
        for n in (SCALE[:2] if args.quick else SCALE):
            rows.append(scale_row(n, rounds=2 if args.quick else 3))
        print(render_scale(rows))
        return 0
    results = run(args)
    print()
    print(render(results))
    if results.get("scale"):
        print()
        print(render_scale(results["scale"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
