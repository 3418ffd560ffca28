"""Where a value was born inside an Inductor-compiled graph (``torch.compile``'s default backend).

Inductor's fused C++ kernels dispatch nothing, and on CPU they call no hook either
(``config.generate_intermediate_hooks`` reaches only extern kernels and Triton/SIMD kernels), so
:func:`nanhunt._locate.graph.locate_graph` cannot see inside them. After a hit only, the failing call
is compiled once more with the user's own Inductor settings (``options``/``mode``, or the
``compile_fx`` keywords such as ``decompositions``) through a capturing ``inner_compile``: it keeps
the post-AOT aten graph Inductor received (already decomposed; nodes carry ``stack_trace`` and
``nn_module_stack``) and each call's real arguments, and still runs the real compiled code.

1. The captured graph is run node by node (``torch.fx.Interpreter``) in place of the compiled code,
   under :class:`nanhunt._locate.graph.GraphMode`: the same walk back from the reported element as
   for any backend that runs its graph in Python. A wrong decomposition is found here: the graph
   Inductor compiles is itself bad.
2. If that run is finite where the compiled one is not (a codegen or fusion bug), prefixes of the
   graph (its nodes up to ``k``; outputs: every value a later node still needs, and node ``k``'s)
   are compiled with the same ``inner_compile`` and settings and compared with the interpreted
   values; a binary search finds the first ``k`` whose compiled prefix makes a value non-finite
   that the interpreted graph has finite: ``log2(nodes)`` compiles, stopped past :data:`BUDGET_S`.

Random numbers: with ``config.fallback_random`` off (the default) Inductor draws them with its own
generator (``prims.inductor_random`` from seeds taken of torch's RNG as the graph starts), so eager
draws others (another dropout mask) and so does ``inductor_random`` run eagerly. The graph up to its
last such node is compiled once more with those nodes as outputs and run from the RNG state the
failing call began at: step 1 runs on the numbers the compiled code drew (as does each compiled
prefix in step 2, from the same state). ``differential`` then does not take the eager replay's
finite value as a compiler bug.

The re-compile goes through a fresh code object of nanhunt's own, so the user's compiled function
keeps its dynamo cache; every Inductor setting is patched only for the duration (``config.patch``).
Anything unexpected gives ``None``: the finding then stays at module level.

Cost, paid only after a hit (2-core CPU, tests/zoo.py's two-Linear models): the capturing re-compile
0.35-0.6 s when the FX graph cache holds the user's own compile of the same graph (2-7 s cold); the
bisection of an 8-node graph 4 prefix compiles, 0.3 s warm to 1.2 s cold (~1 s per cold C++ kernel,
~0.05 s for a prefix of extern kernels only).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import operator
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._steplog import Top
from .._tensors import Path
from .graph import GraphOrigin, _locate_backward, _locate_graph, _source, guarded, origin_at
from .oplevel import _code, _floating
from .replay import faithful

__all__ = ["BUDGET_S", "inductor_settings", "locate_inductor", "locate_inductor_backward"]

BUDGET_S = 60.0  # wall time the bisection may spend compiling prefixes


def inductor_settings(compiled: Any) -> dict[str, Any] | None:
    """The ``compile_fx`` keywords the user's ``torch.compile`` wrapper compiles with (its options
    as ``config_patches``; a ``functools.partial(compile_fx, ...)``'s own keywords); ``None`` when
    its backend is not Inductor."""
    try:
        from torch._dynamo.eval_frame import innermost_backend
        from torch._inductor.compile_fx import compile_fx

        ctx = getattr(compiled, "dynamo_ctx", None)  # torch.compile(model)'s OptimizedModule
        b = innermost_backend(ctx.callback if ctx is not None else _closure(compiled, "callback"))
    except Exception:
        return None
    if isinstance(b, torch._TorchCompileInductorWrapper) and type(b) is torch._TorchCompileInductorWrapper:
        out: dict[str, Any] = {"config_patches": dict(b.config)}
        if b.name is not None:
            out["compile_region_name"] = b.name
        return out
    fn = b
    if isinstance(b, torch._TorchCompileWrapper):
        if b.kwargs:
            return None  # mode/options handed to a compile_fx of the user's: not ours to rebuild
        fn = b.compiler_fn
    if fn is compile_fx:
        return {}
    if isinstance(fn, functools.partial) and fn.func is compile_fx and not fn.args:
        return dict(fn.keywords)
    return None


def _closure(fn: Any, name: str) -> Any:
    """A free variable of ``fn`` (model.compile()'s compiled call keeps its backend as ``callback``)."""
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    return cells[name].cell_contents


_State = tuple[torch.Tensor, list[torch.Tensor] | None]  # the CPU RNG state, CUDA's (once initialised)


def _rng() -> _State:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng(state: _State) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


@dataclass
class _Graph:
    """One forward graph Inductor received: a copy taken before compiling, each call's arguments."""

    gm: torch.fx.GraphModule
    kwargs: dict[str, Any] = field(default_factory=dict)  # compile_fx_inner's keywords for this graph
    args: list[Any] = field(default_factory=list)
    compiled_outs: list[Any] = field(default_factory=list)
    rng: _State | None = None  # the RNG state as the compiled graph began (it draws its seeds from it)
    # Inductor's own random draws (fallback_random off): the values the compiled code drew, per node
    drawn: dict[Any, Any] = field(default_factory=dict)


class _Capture:
    """``inner_compile`` that keeps what Inductor received and, when :attr:`interpret` is on, runs
    the graph node by node instead of the compiled code."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner
        self.graphs: list[_Graph] = []
        self.interpret = False
        self.interpret_backward = False  # backward graphs run node by node (compiled, kept as is)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any, **kw: Any) -> Any:
        if kw.get("is_backward"):
            return self._backward(gm, example_inputs, **kw)
        g = _Graph(copy.deepcopy(gm), {k: v for k, v in kw.items() if k in ("is_inference", "static_input_idxs")})
        real = self.inner(gm, example_inputs, **kw)
        self.graphs.append(g)
        cap = self

        def run(args: list[Any]) -> Any:
            if cap.interpret:
                return _interpreted(g.gm, args, g.drawn)
            g.args = [_own(a) for a in args]
            g.rng = _rng()
            out = real(args)
            g.compiled_outs = [o.detach() if isinstance(o, torch.Tensor) else o for o in out]
            return out

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def _backward(self, gm: torch.fx.GraphModule, example_inputs: Any, **kw: Any) -> Any:
        bw = copy.deepcopy(gm)
        real = self.inner(gm, example_inputs, **kw)
        cap = self

        def run(args: list[Any]) -> Any:
            if cap.interpret_backward:
                return _interpreted(bw, args)
            return real(args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run


def _interpreted(gm: torch.fx.GraphModule, args: list[Any], drawn: dict[Any, Any] | None = None) -> list[Any]:
    """``gm`` run node by node, its outputs as the boxed calling convention returns them (``drawn``:
    the random nodes' values as the compiled code drew them)."""
    out = _Drawn(gm, drawn or {}).run(*args)
    return list(out) if isinstance(out, (tuple, list)) else [out]


class _Drawn(torch.fx.Interpreter):
    """The graph node by node, its random nodes giving what the compiled code drew: eagerly, Inductor's
    ``inductor_random`` ignores its seed (a torch.rand of another mask than the one that failed)."""

    def __init__(self, gm: torch.fx.GraphModule, drawn: dict[Any, Any], **kw: Any) -> None:
        super().__init__(gm, **kw)
        self.drawn = drawn

    def run_node(self, n: torch.fx.Node) -> Any:
        got = self.drawn.get(n)
        return got if got is not None else super().run_node(n)


def random_nodes(gm: torch.fx.GraphModule) -> list[Any]:
    """The nodes that draw random numbers with Inductor's own generator (its ``fallback_random``
    off): ``inductor_random`` and the seeds it takes."""
    ops = {getattr(torch.ops.prims, n).default for n in ("inductor_random", "inductor_seeds", "inductor_seed")
           if hasattr(torch.ops.prims, n)}
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ops]


def _draws(cap: _Capture, g: _Graph) -> dict[Any, Any]:
    """What the compiled graph's random nodes drew in the call recorded: the graph up to its last random
    node compiled with the user's inner compiler (its outputs those nodes), run from the RNG state
    the call began at, so that it draws the same seeds; the user's RNG put back after."""
    rand = random_nodes(g.gm)
    if not rand or g.rng is None:
        return {}
    nodes = [n for n in g.gm.graph.nodes if n.op == "call_function"]
    keep = set(nodes[: max(nodes.index(n) for n in rand) + 1])
    graph = torch.fx.Graph()
    remap: dict[Any, Any] = {}
    for n in g.gm.graph.nodes:
        if n.op == "placeholder" or n.op == "get_attr" or n in keep:
            remap[n] = graph.node_copy(n, lambda a: remap[a])
    graph.output(tuple(remap[n] for n in rand))
    sub = torch.fx.GraphModule(g.gm, graph)
    user = _rng()
    try:
        with torch.no_grad():
            compiled = cap.inner(sub, [_own(a) for a in g.args], **g.kwargs)
            _set_rng(g.rng)
            got = compiled([_own(a) for a in g.args])
    finally:
        _set_rng(user)
    return dict(zip(rand, got))


def _own(a: Any) -> Any:
    """An argument as it was before the call (a graph may write into its non-parameter inputs)."""
    if isinstance(a, torch.Tensor) and not isinstance(a, nn.Parameter):
        return a.detach().clone()
    return a


def _entry(mod: Any, *args: Any, **kwargs: Any) -> Any:
    return mod(*args, **kwargs)


def _fresh_entry() -> Callable[..., Any]:
    """:func:`_entry` on a code object of its own: dynamo keeps its cache on the code object, so
    this re-compile neither touches the user's entries nor outlives the analysis."""
    code = _entry.__code__.replace(co_name=f"_nanhunt_entry_{time.monotonic_ns()}")
    return types.FunctionType(code, _entry.__globals__, code.co_name)


def locate_inductor(compiled: Any, settings: dict[str, Any], top: Top, prefix: str,
                    path: Path | None, keep: Any = (), seen: dict[str, Any] | None = None) -> GraphOrigin | None:
    """The graph node where the compiled ``top`` first made a non-finite value, ``compiled`` being
    a ``torch.compile`` wrapper with the Inductor ``settings`` of :func:`inductor_settings`.
    ``seen`` gets ``random`` (the line of the first node that drew random numbers with Inductor's
    own generator: eager draws others) and ``drawn`` (whether the graph ran on the compiled draws)."""
    return guarded(keep, lambda: _locate(compiled, settings, top, prefix, path, {} if seen is None else seen))


def _capturing(compiled: Any, settings: dict[str, Any], top: Top) -> tuple[_Capture, Callable[..., Any], dict[str, Any]]:
    """A fresh compile of ``top``'s module with the user's Inductor settings through a `_Capture`:
    the capture, the compiled callable, and the Inductor config patches to run it under."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    settings = dict(settings)
    cap = _Capture(settings.pop("inner_compile", compile_fx_inner))
    backend = functools.partial(compile_fx, **settings, inner_compile=cap)
    fn = torch.compile(_fresh_entry(), backend=backend, dynamic=False)
    mod = getattr(compiled, "_orig_mod", None)
    if mod is None:  # model.compile(): the module's own (uncompiled) call
        mod = top.module._call_impl if getattr(top.module, "_compiled_call_impl", None) is not None else top.module

    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(mod, *args, **kwargs)

    return cap, call, settings.get("config_patches") or {}


@contextlib.contextmanager
def _patched(patches: dict[str, Any]) -> Iterator[None]:
    """The user's Inductor settings for the duration, and no AOT cache (a hit would skip
    ``inner_compile``: nothing would be captured)."""
    import torch._functorch.config as functorch_config
    from torch._inductor import config as inductor_config

    with functorch_config.patch(enable_autograd_cache=False), inductor_config.patch(patches):
        yield


def _locate(compiled: Any, settings: dict[str, Any], top: Top, prefix: str, path: Path | None,
            seen: dict[str, Any]) -> GraphOrigin | None:
    cap, call, patches = _capturing(compiled, settings, top)
    with _patched(patches):
        with faithful(top, compiled=True):
            call(*top.args, **(top.kwargs or {}))  # compiles; records each graph's arguments
        if not cap.graphs:
            return None
        if _random_seen(cap, seen):
            seen["drawn"] = False
            for g in cap.graphs:
                g.drawn = _draws(cap, g)
            seen["drawn"] = True
        cap.interpret = True  # the captured graphs run node by node from here on (_bisect compiles its own)
        origin = _locate_graph(call, top, prefix, path)
        if origin is not None:
            seen["interpreted"] = True  # (the graph's own aten ops made it: no codegen bug)
            return origin
        return _bisect(cap, prefix, time.monotonic() + BUDGET_S)


def _random_seen(cap: _Capture, seen: dict[str, Any]) -> bool:
    """Do the captured graphs draw with Inductor's own generator? ``seen["random"]``: the line of
    the first such node."""
    rand = [n for g in cap.graphs for n in random_nodes(g.gm)]
    if rand:
        seen["random"] = next((s for s in (_source(n.meta.get("stack_trace")) for n in rand) if s), "")
    return bool(rand)


def locate_inductor_backward(compiled: Any, settings: dict[str, Any], top: Top, prefix: str,
                             grads: list[torch.Tensor | None], keep: Any = (),
                             seen: dict[str, Any] | None = None) -> GraphOrigin | None:
    """A gradient only the Inductor-compiled backward makes: the backward graph Inductor received,
    run node by node from the compiled forward's saved values (a wrong decomposition; a backward
    codegen bug is not bisected), its node's forward module and line (through ``seq_nr``).
    ``seen["random"]``: as for :func:`locate_inductor` (the forward's random numbers are the
    compiled run's own, in the values it saved)."""
    return guarded(keep, lambda: _locate_bw(compiled, settings, top, prefix, grads, {} if seen is None else seen))


def _locate_bw(compiled: Any, settings: dict[str, Any], top: Top, prefix: str,
               grads: list[torch.Tensor | None], seen: dict[str, Any]) -> GraphOrigin | None:
    cap, call, patches = _capturing(compiled, settings, top)
    with _patched(patches):
        cap.interpret_backward = True
        origin = _locate_backward(call, top, prefix, grads, lambda: [n for g in cap.graphs for n in g.gm.graph.nodes])
        _random_seen(cap, seen)
        return origin


# ---------------------------------------------------------------- codegen bugs: bisection
def _bisect(cap: _Capture, prefix: str, deadline: float) -> GraphOrigin | None:
    """The first node whose compiled prefix makes a value non-finite that the interpreted graph
    has finite (the first graph, in call order, whose compiled outputs are non-finite)."""
    for g in cap.graphs:
        if not any(isinstance(o, torch.Tensor) and _code(o) is not None for o in g.compiled_outs):
            continue
        env = _interpret(g)
        nodes = [n for n in g.gm.graph.nodes if n.op == "call_function"]
        bad_at = functools.cache(functools.partial(_prefix_bad, cap, g, env, nodes))  # each prefix compiled once

        lo, hi = 0, len(nodes) - 1
        if hi < 0 or bad_at(hi) is None:
            continue  # the graph's own nodes compiled alone do not make it: not localised
        while lo < hi:
            if time.monotonic() > deadline:
                return None
            mid = (lo + hi) // 2
            if bad_at(mid) is not None:
                hi = mid
            else:
                lo = mid + 1
        got = bad_at(lo)
        if got is None:
            return None
        return _origin(got[0], got[1], prefix)
    return None


def _interpret(g: _Graph) -> dict[Any, Any]:
    """Every node's value, the graph run node by node on the recorded arguments."""
    it = _Drawn(g.gm, g.drawn, garbage_collect_values=False)
    it.run(*[_own(a) for a in g.args])
    return it.env


def _prefix_bad(cap: _Capture, g: _Graph, env: dict[Any, Any], nodes: list[Any], k: int) -> tuple[Any, torch.Tensor] | None:
    """Compile nodes ``0..k`` with the user's inner compiler (outputs: node ``k`` and every value
    a later node needs); the first output non-finite where the interpreted graph is finite."""
    keep = set(nodes[: k + 1])
    graph = torch.fx.Graph()
    remap: dict[Any, Any] = {}
    for n in g.gm.graph.nodes:
        if n.op == "placeholder" or n.op == "get_attr" or n in keep:
            remap[n] = graph.node_copy(n, lambda a: remap[a])
    frontier = [n for n in nodes[: k + 1] if n is nodes[k] or any(u not in keep for u in n.users)]
    outs = [n for n in frontier if _floating(env.get(n))]
    if not outs:
        return None
    graph.output(tuple(remap[n] for n in outs))
    sub = torch.fx.GraphModule(g.gm, graph)
    user = _rng()
    try:
        with torch.no_grad():  # as AOT runs a compiled forward
            compiled = cap.inner(sub, [_own(a) for a in g.args], **g.kwargs)
            if g.rng is not None:
                _set_rng(g.rng)  # (a prefix that draws: the seeds the graph drew)
            got = compiled([_own(a) for a in g.args])
    finally:
        _set_rng(user)
    for n, o in sorted(zip(outs, got), key=lambda p: p[0] is not nodes[k]):  # node k's own output first
        if isinstance(o, torch.Tensor) and _code(o) is not None and _code(env[n]) is None:
            return n, o
    return None


def _origin(node: Any, value: torch.Tensor, prefix: str) -> GraphOrigin:
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]  # one output of a multi-output op (native_layer_norm): that op
    return origin_at(node, str(node.target), _source(node.meta.get("stack_trace")), tuple(value.shape),
                     str(value.dtype).removeprefix("torch."), _code(value), prefix)
