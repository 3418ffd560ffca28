"""Structure fuzzing: a NaN/Inf planted at a random leaf of a random nesting of tuples, lists and
dicts is reported at that leaf's path and element."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

import nanhunt

from .zoo import expected_element

KEYS = st.text(alphabet="abcxyz_", min_size=1, max_size=4)

# a structure: ("leaf", shape) | ("junk", value) | ("tuple"|"list", [children]) | ("dict", {key: child})
SHAPES = st.lists(st.integers(1, 3), min_size=0, max_size=3).map(tuple)
LEAF = st.one_of(
    SHAPES.map(lambda s: ("leaf", s)),
    st.sampled_from([None, 3, "text", 2.5]).map(lambda v: ("junk", v)),
    SHAPES.map(lambda s: ("int", s)),
)
TREE = st.recursive(
    LEAF,
    lambda kids: st.one_of(
        st.lists(kids, min_size=1, max_size=3).map(lambda k: ("tuple", k)),
        st.lists(kids, min_size=1, max_size=3).map(lambda k: ("list", k)),
        st.dictionaries(KEYS, kids, min_size=1, max_size=3).map(lambda d: ("dict", d)),
    ),
    max_leaves=8,
)


def _leaves(spec: Any, path: str = "output") -> list[tuple[str, tuple[int, ...]]]:
    kind, body = spec
    if kind == "leaf":
        return [(path, body)]
    if kind in ("tuple", "list"):
        return [x for i, k in enumerate(body) for x in _leaves(k, f"{path}[{i}]")]
    if kind == "dict":
        return [x for k, v in body.items() for x in _leaves(v, f"{path}[{k!r}]")]
    return []


def _depth(spec: Any) -> int:
    kind, body = spec
    if kind in ("tuple", "list"):
        return 1 + max(_depth(k) for k in body)
    if kind == "dict":
        return 1 + max(_depth(k) for k in body.values())
    return 0


class Builder(nn.Module):
    """Builds the structure from finite tensors, planting ``value`` at leaf ``target``, flat index ``flat``."""

    def __init__(self, spec: Any, target: str, flat: int, value: float) -> None:
        super().__init__()
        self.spec, self.target, self.flat, self.value = spec, target, flat, value

    def _build(self, spec: Any, path: str, x: torch.Tensor) -> Any:
        kind, body = spec
        if kind == "leaf":
            t = x.new_ones(body) * x.sum()
            if path == self.target:
                t = t.clone()
                t.view(-1)[self.flat] = self.value
            return t
        if kind == "int":
            return torch.ones(body, dtype=torch.int64)
        if kind == "junk":
            return body
        if kind == "tuple":
            return tuple(self._build(k, f"{path}[{i}]", x) for i, k in enumerate(body))
        if kind == "list":
            return [self._build(k, f"{path}[{i}]", x) for i, k in enumerate(body)]
        return {k: self._build(v, f"{path}[{k!r}]", x) for k, v in body.items()}

    def forward(self, x: torch.Tensor) -> Any:
        return self._build(self.spec, "output", x)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=TREE, data=st.data())
def test_planted_leaf_is_found_at_its_path(spec: Any, data: st.DataObject) -> None:
    assume(_depth(spec) <= 5)  # deeper nesting: test_deeply_nested_output_is_still_checked
    leaves = [(p, s) for p, s in _leaves(spec)]
    if not leaves:
        spec, leaves = ("tuple", [spec, ("leaf", (2,))]), [("output[1]", (2,))]
    target, shape = data.draw(st.sampled_from(leaves), label="target")
    numel = 1
    for n in shape:
        numel *= n
    flat = data.draw(st.integers(0, numel - 1), label="flat")
    value = data.draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]), label="value")
    m = Builder(spec, target, flat, value)
    x = torch.ones(2)
    expected = torch.ones(shape) * 2.0
    expected.view(-1)[flat] = value
    with nanhunt.watch(m, on_find="record") as hunt:
        m(x)
    f = hunt.first
    assert f is not None, (spec, target)
    e = expected_element(expected)
    assert (f.tensor, f.index, f.shape, f.dtype, f.counts) == (target, e["index"], e["shape"], "float32", e["counts"])
    assert (f.phase, f.module, f.cause, f.step, f.call) == ("forward", "", "created", 0, 0)
    assert repr(f.value) == repr(value)


def test_deeply_nested_output_is_still_checked() -> None:
    spec: Any = ("leaf", (2,))
    for _ in range(8):
        spec = ("list", [("junk", None), spec])
    leaves = _leaves(spec)
    assert _depth(spec) == 8 and len(leaves) == 1
    m = Builder(spec, leaves[0][0], 1, float("nan"))
    with nanhunt.watch(m, on_find="record") as hunt:
        m(torch.ones(2))
    assert hunt.first is not None and hunt.first.tensor == leaves[0][0] and hunt.first.index == (1,)
