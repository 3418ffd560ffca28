"""nanhunt.audit() and `nanhunt audit`: non-finite tensors of a checkpoint; a malicious file is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

import nanhunt
from nanhunt._cli.main import main
from nanhunt._locate.audit import AuditRefused
from tests import zoo


class _Payload:
    """Unpickling this runs a shell command: what a booby-trapped checkpoint does."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _files(tmp_path: Any) -> dict[str, Any]:
    model = zoo.bnmlp()
    opt = torch.optim.AdamW(model.parameters())
    good = tmp_path / "good.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "callbacks": {"kth_value": torch.tensor(float("inf"))}}, good)
    sd = model.state_dict()
    sd["fc2.bias"][1] = float("nan")
    sd["bn.running_var"][0] = float("inf")
    bad = tmp_path / "bad.pt"
    torch.save({"global_step": 12, "state_dict": sd, "loops": {"x": torch.tensor(float("nan"))}}, bad)
    evil = tmp_path / "evil.pt"
    torch.save({"model": model.state_dict(), "x": _Payload(str(tmp_path / "pwned"))}, evil)
    return {"good": good, "bad": bad, "evil": evil, "marker": tmp_path / "pwned"}


def test_audit_good_and_poisoned(tmp_path: Any) -> None:
    files = _files(tmp_path)
    assert nanhunt.audit(files["good"]) == []
    found = nanhunt.audit(files["bad"])
    assert [(f.phase, f.tensor, f.step) for f in found] == [
        ("checkpoint", "['state_dict']['bn.running_var']", 12),
        ("checkpoint", "['state_dict']['fc2.bias']", 12),
    ]
    assert found[1].index == (1,) and found[1].counts == {"nan": 1, "+inf": 0, "-inf": 0}
    assert found[0].module == os.fspath(files["bad"])
    assert [f.tensor for f in nanhunt.audit(files["bad"], ignore=["*running_var*"])] == ["['state_dict']['fc2.bias']"]
    obj = torch.load(files["bad"], weights_only=True)
    assert len(nanhunt.audit(obj)) == 2


def test_audit_refuses_a_file_that_would_run_code(tmp_path: Any) -> None:
    files = _files(tmp_path)
    with pytest.raises(ValueError, match="refused"):
        nanhunt.audit(files["evil"])
    assert not files["marker"].exists()


def test_cli_exit_codes(tmp_path: Any, capsys: Any) -> None:
    files = _files(tmp_path)
    assert main(["audit", str(files["good"])]) == 0
    assert main(["audit", str(files["bad"])]) == 3
    out = capsys.readouterr().out
    assert "['state_dict']['fc2.bias']" in out and "1 nan" in out
    assert main(["audit", str(files["bad"]), "--ignore", "*.bias", "--ignore", "*running_var"]) == 0
    assert main(["audit", str(files["evil"])]) == 2
    assert "refused" in capsys.readouterr().err
    assert not files["marker"].exists()
    assert main(["audit", str(tmp_path / "missing.pt")]) == 2



def test_ignore_takes_a_key_path_as_audit_prints_it(tmp_path: Any, capsys: Any) -> None:
    # `--ignore "['state_dict']['mask']"` (the form --help and audit's own lines give) matched nothing:
    # fnmatch read its brackets as sets of characters, which also hid every last key starting with one
    files = _files(tmp_path)
    assert main(["audit", str(files["bad"]), "--ignore", "['state_dict']['fc2.bias']"]) == 3
    out = capsys.readouterr().out
    assert "running_var" in out and "fc2.bias" not in out
    kept = nanhunt.audit(files["bad"], ignore=["['state_dict']['*.bias']"])
    assert [f.tensor for f in kept] == ["['state_dict']['bn.running_var']"]
    assert nanhunt.audit(files["bad"], ignore=["['state_dict']*"]) == []
    assert [f.tensor for f in nanhunt.audit(files["bad"], ignore=["['bn']*"])] == [
        "['state_dict']['bn.running_var']", "['state_dict']['fc2.bias']"]
    assert [f.tensor for f in nanhunt.audit(files["bad"], ignore=["fc[0-9].bias"])] == ["['state_dict']['bn.running_var']"]

# ---------------------------------------------------------------- hostile files: one line naming the file, exit 2
def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _unblock_after(fifo: Any, seconds: float = 20.0) -> Any:
    """Opens ``fifo`` for writing later, so a reader wrongly blocked in open() fails the test instead of hanging it."""
    import threading

    def go() -> None:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass

    t = threading.Timer(seconds, go)
    t.daemon = True
    t.start()
    return t


def test_audit_of_unreadable_safetensors_is_one_line_exit_2(tmp_path: Any, capsys: Any) -> None:
    pytest.importorskip("safetensors")
    import struct

    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(bytes(range(256)) * 2)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 2**62) + b"{}")  # a header that claims 2**62 bytes
    for f in (garbage, huge):
        with pytest.raises(AuditRefused, match=f.name):
            nanhunt.audit(f)
        assert main(["audit", str(f)]) == 2
        line = _one_line(capsys.readouterr().err)
        assert str(f) in line and "safetensors" in line and "SafetensorError" not in line


def test_audit_of_a_truncated_or_foreign_file_says_so(tmp_path: Any, capsys: Any) -> None:
    files = _files(tmp_path)
    data = files["good"].read_bytes()
    cut = []
    for i, frac in enumerate((0.2, 0.6, 0.95)):  # torch fails on these with RuntimeError or OSError [Errno 22]
        cut.append(tmp_path / f"trunc{i}.pt")
        cut[-1].write_bytes(data[: int(len(data) * frac)])
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(bytes((i * 97 + 13) % 256 for i in range(5000)))  # not a zip, not a pickle
    text = tmp_path / "text.pt"
    text.write_text("hello world\n")
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    for f, says in (*((c, "truncated") for c in cut), (garbage, "neither a zip file"), (text, "neither a zip file"), (empty, "empty")):
        with pytest.raises(ValueError, match="not a checkpoint torch can read") as e:  # AuditRefused, as for any bad file
            nanhunt.audit(f)
        assert not isinstance(e.value, OSError) and str(e.value).startswith(f"{f}: ")
        assert says in str(e.value).removeprefix(f"{f}: ")  # (the test's folder is named "...truncated...")
        assert main(["audit", str(f)]) == 2
        line = _one_line(capsys.readouterr().err)
        assert line.startswith(f"nanhunt: {f}: not a checkpoint torch can read") and says in line.split(": ", 2)[2], line
        assert "run code" not in line and "Errno" not in line, line


def test_audit_refusal_names_the_global_and_never_relays_torchs_advice(tmp_path: Any, capsys: Any) -> None:
    files = _files(tmp_path)
    assert main(["audit", str(files["evil"])]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "refused" in line and "posix.system" in line, line
    assert "weights_only` set to `False" not in line and "will likely succeed" not in line
    assert not files["marker"].exists()


def test_audit_of_a_folder_a_device_or_a_fifo_names_what_it_is(tmp_path: Any, capsys: Any) -> None:
    folder = tmp_path / "ckpt.pt"
    folder.mkdir()
    zero = tmp_path / "zero.pt"
    zero.symlink_to("/dev/zero")  # endless: must never be read
    fifo = tmp_path / "fifo.pt"
    os.mkfifo(fifo)  # nobody writes: opening it to read would block for good
    _unblock_after(fifo)
    for f, what in ((folder, "is a folder"), (zero, "is a character device"), (fifo, "is a FIFO")):
        with pytest.raises(ValueError, match=what):
            nanhunt.audit(f)
        assert main(["audit", str(f)]) == 2
        line = _one_line(capsys.readouterr().err)
        said = f"nanhunt: {f} {what}{' (named pipe)' if f is fifo else ''}, not a checkpoint file"
        assert line == said if f is not folder else line.startswith(said), line
    assert main(["audit", str(tmp_path / "missing.pt")]) == 2
    assert "no such checkpoint" in _one_line(capsys.readouterr().err)


def test_audit_of_a_checkpoint_folder_names_the_files_to_audit(tmp_path: Any, capsys: Any) -> None:
    folder = tmp_path / "checkpoint-500"  # what Hugging Face's Trainer writes
    folder.mkdir()
    for name in ("model.safetensors", "optimizer.pt", "config.json", "trainer_state.json"):
        (folder / name).write_bytes(b"")
    assert main(["audit", str(folder)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line == f"nanhunt: {folder} is a folder, not a checkpoint file; audit the files in it (model.safetensors, optimizer.pt)"


def test_a_file_name_from_a_folder_is_printed_escaped_never_as_a_terminal_command(tmp_path: Any, capsys: Any) -> None:
    """A downloaded checkpoint folder's file name holding an escape sequence and a newline went raw
    to the terminal: in the list of files to audit, and as the path on each line of the listing."""
    folder = tmp_path / "checkpoint-500"
    folder.mkdir()
    name = "x\x1b]0;owned\x07\nnanhunt: fake.pt"
    torch.save({"w": torch.tensor([float("nan")])}, folder / name)
    assert main(["audit", str(folder)]) == 2
    assert main(["audit", str(folder / name)]) == 3
    out, err = capsys.readouterr()
    for said in (out, err):
        assert "\x1b" not in said and "\x07" not in said and "\nnanhunt: fake" not in said, said
        assert "x\\x1b]0;owned\\x07\\x0ananhunt: fake.pt" in said, said
    assert len(err.splitlines()) == 1


def test_a_tensor_nested_however_deep_is_judged_file_object_and_cli(tmp_path: Any, capsys: Any) -> None:
    """A checkpoint nested 300 levels deep (a trainer's state chain, a list of per-epoch dicts) with
    an inf at the bottom was reported clean: the walk stopped silently at depth 64."""
    obj: Any = {"w": torch.tensor([1.0, float("inf")])}
    for i in range(300):
        obj = {"k": obj} if i % 2 else [obj]
    path = tmp_path / "deep.pt"
    torch.save(obj, path)
    for found in (nanhunt.audit(path), nanhunt.audit(obj)):
        assert len(found) == 1 and found[0].tensor.endswith("['w']") and found[0].index == (1,)
    assert main(["audit", str(path)]) == 3
    assert "+inf" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [[3], None, 5, b"*.weight"])
def test_audit_names_a_bad_ignore_argument(bad: Any) -> None:
    with pytest.raises(TypeError, match="^ignore must be"):
        nanhunt.audit({"w": torch.ones(1)}, ignore=bad)


def _sparse(layout: str) -> torch.Tensor:
    """A 2x3 sparse tensor whose first non-finite element in row-major order is ``inf`` at [0, 2]."""
    inf, nan = float("inf"), float("nan")
    if layout == "coo_uncoalesced":  # stored out of order, [1, 0] twice: the first stored bad value is not the first
        return torch.sparse_coo_tensor([[1, 0, 1, 0], [0, 2, 0, 1]], [nan, inf, 1.0, 2.0], (2, 3), check_invariants=True)
    dense = torch.tensor([[0.0, 2.0, inf], [nan, 0.0, -inf]])
    return dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning")
@pytest.mark.parametrize("layout", ["coo", "csr", "coo_uncoalesced"])
def test_a_sparse_tensor_is_judged_by_its_values_at_its_dense_index(layout: str, tmp_path: Any, capsys: Any) -> None:
    """A sparse tensor's NaN/Inf was never seen (only strided tensors were judged): audit said clean, exit 0."""
    s = _sparse(layout)
    assert s.layout is (torch.sparse_csr if layout == "csr" else torch.sparse_coo)
    assert s.is_coalesced() is (layout == "coo") if s.layout is torch.sparse_coo else True
    path = tmp_path / "sparse.pt"
    torch.save({"step": 4, "emb": s, "ok": torch.ones(2, 2).to_sparse()}, path)
    counts = {"nan": 1, "+inf": 1, "-inf": 0 if layout == "coo_uncoalesced" else 1}
    for found in (nanhunt.audit(path), nanhunt.audit({"step": 4, "emb": s})):
        assert [(f.phase, f.tensor, f.step, f.shape) for f in found] == [("checkpoint", "['emb']", 4, (2, 3))]
        assert (found[0].index, found[0].value, found[0].counts) == ((0, 2), float("inf"), counts)  # s.to_dense()[0, 2]
    assert main(["audit", str(path)]) == 3
    out = capsys.readouterr().out
    assert "['emb']" in out and "first [0, 2] = inf" in out and "['ok']" not in out
    assert nanhunt.audit(path, ignore=["emb"]) == []


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning")
@pytest.mark.parametrize("kind", ["coo", "csr"])
def test_a_crafted_sparse_tensor_is_refused_not_read_out_of_bounds(kind: str, tmp_path: Any) -> None:
    """A file holding a sparse tensor whose indices point past its shape (built without the checks,
    as a crafted file holds them) loaded under weights_only=True: a COO one was reported as a
    finding at index [10000000] of a (4,) tensor, a CSR one crashed the process (malloc's
    "invalid chunk size", exit 139). Invariants are checked as the file loads: refused, exit 2."""
    from tests.test_bundle import _crafted_sparse

    path = tmp_path / "crafted.pt"
    torch.save({"emb": _crafted_sparse(kind)}, path)
    p = subprocess.run([sys.executable, "-m", "nanhunt", "audit", str(path)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "not a checkpoint torch can read" in p.stderr, (p.returncode, p.stderr)
    if kind == "coo":  # (in this process only what cannot crash it)
        with pytest.raises(AuditRefused, match="size is inconsistent with indices"):
            nanhunt.audit(path)


def test_audit_takes_a_bytes_path_and_refuses_what_is_no_checkpoint(tmp_path: Any) -> None:
    """audit(b"path") said 'clean' for a file holding NaN, and audit(None) / audit(123) too."""
    import torch

    import nanhunt

    path = tmp_path / "nan.pt"
    torch.save({"w": torch.tensor([1.0, float("nan")])}, path)
    (f,) = nanhunt.audit(os.fsencode(str(path)))
    assert f.tensor == "['w']" and f.index == (1,)
    for bad in (None, 123, 1.5):
        with pytest.raises(TypeError, match="takes a checkpoint's path or the object loaded from it"):
            nanhunt.audit(bad)


def test_audit_of_an_open_file_or_a_generator_is_refused_not_called_clean(tmp_path: Any) -> None:
    """audit(open(path, "rb")), audit(io.BytesIO(...)) (what torch.load takes) and audit of a
    generator were walked as objects holding no tensor: [] ("clean") for a checkpoint full of NaN."""
    import io

    path = tmp_path / "nan.pt"
    torch.save({"w": torch.tensor([1.0, float("nan")])}, path)
    buf = io.BytesIO(path.read_bytes())
    with open(path, "rb") as fh:
        for bad in (fh, buf, (t for t in [torch.tensor(float("nan"))])):
            with pytest.raises(TypeError, match=f"got {type(bad).__name__}, whose tensors it cannot see"):
                nanhunt.audit(bad)
    (f,) = nanhunt.audit(torch.load(buf, weights_only=True))  # the advice works
    assert f.tensor == "['w']" and f.index == (1,)


def test_a_tensor_held_under_many_keys_is_one_finding_and_deep_key_paths_are_cut(tmp_path: Any, capsys: Any) -> None:
    # a 400 KB file that refers to one NaN tensor 200,000 times printed 200,000 findings in 48 s;
    # tied weights (an embedding and the head that shares it) are one tensor too
    bad = torch.tensor([1.0, float("nan")])
    tied = {"embed.weight": bad, "head.weight": bad, "ok": torch.ones(2)}
    assert [f.tensor for f in nanhunt.audit(tied)] == ["['embed.weight']"]
    torch.save(tied, tmp_path / "tied.pt")  # loaded back: one tensor object per key, over one storage
    assert [f.tensor for f in nanhunt.audit(tmp_path / "tied.pt")] == ["['embed.weight']"]
    fan = tmp_path / "fan.pt"
    torch.save([bad] * 20_000, fan)
    assert [f.tensor for f in nanhunt.audit(fan)] == ["[0]"]
    deep: Any = bad
    for _ in range(500):
        deep = [deep]
    (f,) = nanhunt.audit(deep)
    assert f.tensor == "[0]" * 16 + "…468 levels…" + "[0]" * 16


def test_a_zip_bomb_is_refused_before_anything_is_loaded(tmp_path: Any, monkeypatch: Any, capsys: Any) -> None:
    import zipfile

    from nanhunt._locate import checkpoint

    monkeypatch.setattr(checkpoint, "MAX_FREE", 1 << 20)  # the same rule as at 256 MiB, on a small file
    ok = tmp_path / "ok.pt"
    torch.save({"w": torch.zeros(1 << 19)}, ok)  # 2 MB stored uncompressed, as torch.save does
    assert nanhunt.audit(ok) == []
    bomb = tmp_path / "bomb.pt"
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as z, z.open("bomb/data/0", "w") as fh:
        for _ in range(8):
            fh.write(bytes(1 << 20))  # 8 MB of zeros in a few KB
    with pytest.raises(AuditRefused, match="inflate to 8,388,608 bytes from a"):
        nanhunt.audit(bomb)
    assert main(["audit", str(bomb)]) == 2
    assert "nothing was loaded" in _one_line(capsys.readouterr().err)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning")
@pytest.mark.parametrize("layout", ["strided", "jagged"])
def test_a_nested_tensor_is_judged_by_its_values_at_its_component_index(layout: str, tmp_path: Any, capsys: Any) -> None:
    """A nested tensor holding NaN crashed audit (strided: "NestedTensorImpl doesn't support sizes",
    `nanhunt audit` a traceback, exit 1) or was reported clean (jagged: its layout was not judged).
    Its element is (component, index within it), its shape the padded one, as the watch reports them."""
    kw = {"layout": torch.jagged} if layout == "jagged" else {}
    nt = torch.nested.nested_tensor([torch.tensor([1.0, 2.0]), torch.tensor([3.0, float("inf"), float("nan")])], **kw)
    ok = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], **kw)
    path = tmp_path / "nested.pt"
    torch.save({"n": nt, "ok": ok}, path)
    for found in (nanhunt.audit(path), nanhunt.audit({"n": nt, "ok": ok})):
        assert [(f.tensor, f.index, f.value, f.shape) for f in found] == [("['n']", (1, 1), float("inf"), (2, 3))]
        assert found[0].counts == {"nan": 1, "+inf": 1, "-inf": 0}
        assert nt.unbind()[1][1] == found[0].value
    assert main(["audit", str(path)]) == 3
    out = capsys.readouterr().out
    assert "['n']  (2, 3) float32" in out and "first [1, 1] = inf" in out and "['ok']" not in out


def test_a_view_of_more_elements_than_its_storage_is_judged_by_its_storage(tmp_path: Any) -> None:
    """A 1 KB file holding a 10**9 x 10**9 view of one float (stride 0) made audit sum 10**18
    elements: minutes of CPU for a file it should judge at once. Overlapping strides do the same
    with a few hundred floats. Such a view is judged by the storage it reaches; the finding is still
    the view's first non-finite element and its counts over all its elements."""
    nan, inf = float("nan"), float("inf")
    s = torch.zeros(1000)
    s[998], s[500] = inf, nan
    views = {
        "expanded": torch.tensor([0.0, nan]).as_strided((10**9, 10**9), (0, 0), 1),
        "overlap": s.as_strided((100,) * 9, (1,) * 8 + (2,)),  # 10**18 elements over 1,000 floats
        "gaps": torch.tensor([nan, 1.0, inf, 2.0]).as_strided((3, 10**9), (1, 0), 1),  # reads 1, inf, 2
    }
    path = tmp_path / "views.pt"
    torch.save(views, path)
    try:
        p = subprocess.run([sys.executable, "-m", "nanhunt", "audit", str(path)], capture_output=True, text=True,
                           timeout=15)
    except subprocess.TimeoutExpired:
        pytest.fail("nanhunt audit of a 1 KB file ran past 15 s")
    assert p.returncode == 3, (p.returncode, p.stderr)
    assert "['expanded']  (1000000000, 1000000000) float32: 1000000000000000000 nan" in p.stdout, p.stdout
    for found in (nanhunt.audit(path), nanhunt.audit(views)):
        assert [(f.tensor, f.index, str(f.value)) for f in found] == [
            ("['expanded']", (0, 0), "nan"), ("['overlap']", (0, 0, 0, 0, 5, 99, 99, 99, 99), "nan"),
            ("['gaps']", (1, 0), "inf")]
        for name, f in zip(views, found):
            assert f.shape == tuple(views[name].shape) and str(views[name][f.index].item()) == str(f.value)
        assert found[0].counts == {"nan": 10**18, "+inf": 0, "-inf": 0}
        assert found[1].counts["+inf"] == 0  # (no index of the view reaches offset 998)
        assert found[2].counts == {"nan": 0, "+inf": 10**9, "-inf": 0}  # the nan before its first element: unread


def test_a_file_nesting_lists_thousands_deep_is_walked_in_linear_memory(tmp_path: Any, capsys: Any) -> None:
    """A valid torch.save file whose pickle nests lists 40,000 deep took 23 s to audit (80,000: killed
    for memory): the walk made each level's whole key path a tuple, all of them held at once."""
    import tracemalloc
    import zipfile

    path, depth = tmp_path / "deep.pt", 10_000
    torch.save({"w": torch.tensor([1.0, float("nan")])}, path)
    with zipfile.ZipFile(path) as z:
        records = [(info, z.read(info)) for info in z.infolist()]
    with zipfile.ZipFile(path, "w") as z:  # the pickle wrapped in `depth` lists: ]]]...{'w': tensor}aaa...
        for info, data in records:
            if info.filename.endswith("/data.pkl"):
                assert data[:2] == b"\x80\x02" and data[-1:] == b"."
                data = data[:2] + b"]" * depth + data[2:-1] + b"a" * depth + b"."
            z.writestr(info, data)
    tracemalloc.start()
    try:
        (f,) = nanhunt.audit(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert f.tensor == "[0]" * 16 + f"…{depth - 31} levels…" + "[0]" * 15 + "['w']" and f.index == (1,)
    assert peak < 40 << 20, peak  # (a tuple per level: 400 MB)
    assert main(["audit", str(path)]) == 3
    assert "1 nan" in capsys.readouterr().out


def test_all_bad_names_exactly_the_non_finite_tensors_of_a_mixed_list() -> None:
    """The analysis judges every gradient, weight and state tensor at once (`Report.damage`, an
    audit): small plain ones joined a few thousand at a time, the rest one by one. Whatever the
    mix (dtypes, views, sparse, sizes past the join) and wherever the NaN/Inf, exactly the tensors
    holding one are named, as a check of each alone says."""
    from nanhunt._locate.checkpoint import _is_bad, all_bad, judgeable

    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        ts: list[torch.Tensor] = []
        for k in range(int(torch.randint(1, 40, (1,), generator=g))):
            kind = int(torch.randint(0, 7, (1,), generator=g))
            n = int(torch.randint(1, 50, (1,), generator=g))
            if kind == 0:
                t = torch.randn(n, 3, generator=g)
            elif kind == 1:
                t = torch.randn(n, 3, generator=g).half()
            elif kind == 2:
                t = torch.randn(3, n, generator=g).t()  # not contiguous
            elif kind == 3:
                t = torch.randn(1, n, generator=g).expand(4, n)  # reads each element four times
            elif kind == 4:
                t = torch.randn(70_000, generator=g)  # past the join
            elif kind == 5:
                t = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.randn(2, generator=g), (n + 3,))
            else:
                t = nn.Parameter(torch.randn(n, generator=g))
            if bool(torch.rand(1, generator=g) < 0.3):
                v = t._values() if t.layout is torch.sparse_coo else t
                with torch.no_grad():
                    if v.is_contiguous():
                        v.view(-1)[int(torch.randint(0, v.numel(), (1,), generator=g))] = (
                            float("nan") if k % 2 else float("-inf"))
                    else:  # (a view: its first element's storage)
                        v.as_strided((1,), (1,), v.storage_offset()).fill_(float("inf"))
            ts.append(t)
        truth = [i for i, t in enumerate(ts) if judgeable(t) and _is_bad(t)]
        assert all_bad(ts) == truth, (trial, [(tuple(t.shape), t.dtype, t.layout) for t in ts])
        ts32 = [t for t in ts if t.dtype is torch.float32 and t.layout is torch.strided and t.is_contiguous()]
        assert all_bad(ts32) == [i for i, t in enumerate(ts32) if _is_bad(t)]  # (the one-dispatch path)
