"""What the cheap hot path leaves out must still be found: passthrough modules, containers handing
on a child's output, backward without per-module hooks, and the opt-in per-module hooks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanhunt


class LogThenReLU(nn.Module):
    """Its own code makes -inf (log of 0), then a ReLU (not probed on the hot path) hands it on."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(torch.log(torch.relu(self.lin(x))) * -1.0)  # -log(0) = +inf


def test_value_born_before_a_passthrough_module_is_found_where_it_was_born():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), LogThenReLU(), nn.Linear(4, 1))
    with nanhunt.watch(model, on_find="record") as hunt:
        model(torch.randn(8, 4))
    f = hunt.first
    assert (f.phase, f.module, f.module_type, f.cause) == ("forward", "1", "LogThenReLU", "created")
    assert f.op == "aten.log.default" and f.value == float("inf")


class SqrtAtZero(nn.Module):
    def forward(self, x):
        return x + torch.sqrt(x * 0)  # finite forward; d sqrt at 0 = inf, times 0 = nan


@pytest.mark.parametrize("grad_hooks", [False, True])
def test_backward_creator_found_with_and_without_per_module_hooks(grad_hooks):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SqrtAtZero(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(nanhunt.NonFiniteError) as ei:
        with nanhunt.watch(model, optimizer=opt, grad_hooks=grad_hooks):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
    f = ei.value.finding
    assert (f.phase, f.module, f.tensor, f.cause) == ("backward", "1", "grad_input[0]", "created")
    assert f.op == "SqrtBackward0"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    message = str(ei.value)  # the one-paragraph summary a person reads
    assert message == f.summary() and message.startswith("First NaN: backward of `1` (SqrtAtZero) at step 0")
    assert "SqrtBackward0" in message and "float32" in message


def test_per_module_hooks_locate_backward_even_without_a_replay():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SqrtAtZero(), nn.Linear(4, 1))
    with nanhunt.watch(model, on_find="record", grad_hooks=True, replay=False) as hunt:
        model(torch.randn(3, 4)).sum().backward()
    f = hunt.first
    assert (f.phase, f.module, f.tensor) == ("backward", "1", "grad_input[0]")
    assert f.index is None  # no replay: the module is known, the element is not


def test_container_handing_on_its_childs_output_is_not_a_second_finding():
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 4), LogThenReLU())
    model = nn.Sequential(inner, nn.Identity())
    with nanhunt.watch(model, on_find="record") as hunt:
        model(torch.randn(8, 4))
    assert [f.module for f in hunt.findings if f.phase == "forward"] == ["0.1"]
