"""`nanhunt demo`: a tiny GPT that really blows up, caught by `nanhunt.watch`.

The mechanism is a classic one: the model runs under fp16 autocast and Adam's learning rate (0.1)
is far too high. The query/key weights grow step after step until one attention logit ``q·k``
passes float16's largest value (65504): the logit becomes ``inf``, and the softmax over its row
turns it into ``nan`` (``inf - inf``). nanhunt names the attention module, the step and the element.

Everything is seeded and runs on one CPU thread, without oneDNN, and `nanhunt demo` takes torch's
portable float code paths (`_cli.main.DEMO_ENV`); Adam runs its fused kernel, whose square root is
the CPU's own (the default kernel's ``sqrt`` is MKL's vector math, which rounds differently by CPU
and moved the blow-up from step 119 to 117 between an Intel and an AMD machine). So the blow-up
happens at the same step each time, on any x86 machine.
"""

from __future__ import annotations

import linecache
import os
import sys
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._report import print_report

__all__ = ["TinyGPT", "train", "main"]

VOCAB, WIDTH, LAYERS, SEQ, BATCH, LR, SHIFT = 16, 32, 2, 16, 32, 0.1, 3  # as TinyGPT's defaults


# The model is compiled under its own file name, ``tinygpt.py`` (registered with linecache), so that
# the finding's source line points at the model's code: nanhunt never blames lines of its own package.
MODEL_FILE = "tinygpt.py"
MODEL_SOURCE = '''\
import math

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        logits = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)  # can overflow float16
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = logits.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=16, d=32, heads=2, layers=2, seq=16):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
'''


def _load_model_code() -> dict[str, Any]:
    linecache.cache[MODEL_FILE] = (len(MODEL_SOURCE), None, MODEL_SOURCE.splitlines(True), MODEL_FILE)
    ns: dict[str, Any] = {"__name__": "nanhunt_demo_tinygpt"}
    exec(compile(MODEL_SOURCE, MODEL_FILE, "exec"), ns)
    return ns


TinyGPT: type[nn.Module] = _load_model_code()["TinyGPT"]


class _Progress:
    """A progress bar: ``rich`` when installed and writing to a terminal, else a ``\\r`` line."""

    def __init__(self, total: int, stream: Any) -> None:
        self.total, self.stream, self._rich, self._last = total, stream, None, 0.0
        if stream.isatty():
            try:
                from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
            except ImportError:
                pass
            else:
                self._rich = Progress(TextColumn("training"), BarColumn(), TextColumn("step {task.completed}/"
                                      "{task.total}"), TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(),
                                      transient=False)
                self._task = self._rich.add_task("train", total=total, loss="-")
                self._rich.start()

    def update(self, step: int, loss: float | None) -> None:
        shown = "-" if loss is None else f"{loss:.3f}"
        if self._rich is not None:
            self._rich.update(self._task, completed=step, loss=shown)
            return
        tty = self.stream.isatty()
        now = time.monotonic()
        if now - self._last < (0.1 if tty else 2.0) and step < self.total:
            return
        self._last = now
        width = 30
        filled = int(width * step / max(1, self.total))
        line = f"training [{'#' * filled}{'.' * (width - filled)}] step {step}/{self.total} loss {shown}"
        self.stream.write(f"\r{line}" if tty else f"{line}\n")
        self.stream.flush()

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
        elif self.stream.isatty():
            self.stream.write("\n")
            self.stream.flush()


def train(steps: int = 300, *, progress: Any = None) -> Any:
    """Train the tiny GPT under fp16 autocast with a far too high LR; returns the hunt's `Report`."""
    import nanhunt

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # same reduction order on every machine: the same blow-up step
    # float16 matmuls take torch's own kernels, not oneDNN's: oneDNN picks its kernels by the CPU
    # (AVX512-FP16, AMX), and their rounding moved the blow-up by tens of steps between machines
    mkldnn = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        torch.manual_seed(0)
        data = torch.Generator().manual_seed(0)
        model = TinyGPT()
        opt = torch.optim.Adam(model.parameters(), lr=LR, fused=True)  # sqrt not by MKL: see the docstring
        hunt = nanhunt.watch(model, opt, on_find="raise")
        try:
            with hunt:
                for step in range(steps):
                    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=data)
                    y = torch.roll(x, SHIFT, dims=1)  # task: repeat the token SHIFT places back
                    with torch.autocast("cpu", dtype=torch.float16):
                        logits = model(x)
                    loss = F.cross_entropy(logits.float()[:, SHIFT:].reshape(-1, VOCAB), y[:, SHIFT:].reshape(-1))
                    hunt.check(loss, "loss")
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    if progress is not None:
                        progress.update(step + 1, float(loss.detach()))
        except nanhunt.NonFiniteError as e:
            return e.report
        return hunt.report
    finally:
        torch._C._set_mkldnn_enabled(mkldnn)
        torch.set_num_threads(threads)


def main(out: str | None = None, steps: int | None = None, report: str | None = None) -> int:
    """Run the demo: the report on stdout, progress on stderr, the HTML page at ``out`` (default:
    ``nanhunt-demo.html`` in the temp folder). 0 when it caught the blow-up, 1 when it did not, 2 when a
    page or report could not be written (said in one line)."""
    if out is None:
        out = os.path.join(tempfile.gettempdir(), "nanhunt-demo.html")
    if steps is None:
        steps = int(os.environ.get("NANHUNT_DEMO_STEPS", "300"))
    err = sys.stderr
    print(f"nanhunt demo: a tiny GPT ({LAYERS} blocks, width {WIDTH}) trained under fp16 autocast with Adam at "
          f"lr={LR} — far too high — for up to {steps} steps.", file=err)
    bar = _Progress(steps, err)
    t0 = time.monotonic()
    try:
        result = train(steps, progress=bar)
    finally:
        bar.close()
    print(f"({time.monotonic() - t0:.1f} s)\n", file=err)
    print_report(result)
    if result.first is None:
        print(f"\nNo NaN/Inf in {steps} steps: the demo needs more steps to blow up.", file=err)
        return 1
    for label, path in (("\nHTML report", out), ("report", report)):
        if not path:
            continue
        try:  # (checked when given; a full disk, or a FIFO nobody reads, fails only now)
            print(f"{label}: {os.path.abspath(result.save(path))}", file=err)
        except OSError as e:
            print(f"nanhunt: cannot write {path!r}: {e}", file=err)
            return 2
    return 0
