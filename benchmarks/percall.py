"""Per-call cost of bngrad on small layers, against PyTorch in the same process (issue 12).

For each shape and dtype, times in interleaved rounds (every contender a burst of calls per
round, so that drifts in the machine's speed hit all alike) and prints median microseconds per
call:

- ``np fwd``: ``bngrad.batch_norm_forward`` in training mode with running statistics, as a
  module calls it; ``np bwd``: ``bngrad.batch_norm_backward``, all three gradients;
- ``torch fwd`` / ``torch bwd``: PyTorch's ``native_batch_norm`` and
  ``native_batch_norm_backward`` on the same memory (the NumPy calls' counterparts);
- ``bngrad.torch f+b``: ``bngrad.torch.functional.batch_norm`` forward + ``backward()``
  (eager autograd), and ``PyTorch f+b``: ``torch.nn.functional.batch_norm`` the same way,
  with their ratio.

Tiny shapes show the fixed cost of a call; the others where serial launches, the parallel
threshold and the per-call Python work matter. ``--baseline FILE`` adds the columns of an
earlier run saved with ``--json`` (e.g. the tree before a change, run with
``PYTHONPATH=/tmp/before/src``), with the ratio after / before.

    .venv/bin/python benchmarks/percall.py
    PYTHONPATH=/tmp/before/src .venv/bin/python benchmarks/percall.py --json /tmp/before.json
    .venv/bin/python benchmarks/percall.py --baseline /tmp/before.json

``--threshold`` instead measures where a parallel launch starts to pay, the figure behind
``kernels.Config.serial_elements`` (docs/internals.md): the same forward and backward calls on
growing arrays, forced serial and forced parallel, with Numba's pool hot and right after a
PyTorch operator, and prints the value they imply. Measure on an idle machine; figures on a
shared one are only indicative.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np

import bngrad

SHAPES = [(2, 4, 3, 3), (16, 128, 14, 14), (16, 512, 4, 4), (64, 64, 8, 8)]
DTYPES = ["float32", "bfloat16"]
COLUMNS = ["np fwd", "np bwd", "torch fwd", "torch bwd", "bngrad.torch f+b", "PyTorch f+b"]


def _shape(text: str) -> tuple:
    return tuple(int(s) for s in text.split(","))


def _contenders(shape: tuple, dtype: str, threads: int) -> Dict[str, Callable[[], Any]]:
    import torch
    import torch.nn.functional as F

    import bngrad.torch as bt

    torch_dtype = getattr(torch, dtype)
    C = shape[1]
    gen = torch.Generator().manual_seed(0)
    xt = torch.randn(shape, generator=gen).to(torch_dtype).requires_grad_()
    dyt = torch.randn(shape, generator=gen).to(torch_dtype)
    wt = torch.rand(C, generator=gen).add_(0.5).to(torch_dtype).requires_grad_()
    bt_ = torch.randn(C, generator=gen).to(torch_dtype).requires_grad_()
    rm, rv = torch.zeros(C, dtype=torch_dtype), torch.ones(C, dtype=torch_dtype)
    rm_np, rv_np = rm.clone(), rv.clone()  # the NumPy calls' own running statistics

    def np_view(t: Any) -> np.ndarray:
        from bngrad.torch._convert import to_numpy
        return to_numpy(t.detach())

    x, dy, w, b = np_view(xt), np_view(dyt), np_view(wt), np_view(bt_)
    _, save_mean, save_invstd = bngrad.batch_norm_forward(x, w, b, None, None, True,
                                                          num_threads=threads)
    out = np.empty_like(x)
    xd, wd = xt.detach(), wt.detach()
    _, tsm, tsi = torch.ops.aten.native_batch_norm(xd, wd, bt_.detach(), None, None, True, 0.1,
                                                   1e-5)  # PyTorch's own saved statistics
    mask = [True, True, True]

    def np_fwd() -> None:
        bngrad.batch_norm_forward(x, w, b, np_view(rm_np), np_view(rv_np), True, 0.1, 1e-5,
                                  num_threads=threads)

    def np_bwd() -> None:
        bngrad.batch_norm_backward(dy, x, w, None, None, save_mean, save_invstd, True, 1e-5,
                                   (True, True, True), num_threads=threads, out=out)

    def torch_fwd() -> None:
        torch.ops.aten.native_batch_norm(xd, wd, bt_.detach(), None, None, True, 0.1, 1e-5)

    def torch_bwd() -> None:
        torch.ops.aten.native_batch_norm_backward(dyt, xd, wd, None, None, tsm, tsi, True,
                                                  1e-5, mask)

    def bngrad_fb() -> None:
        bt.functional.batch_norm(xt, rm, rv, wt, bt_, True).backward(dyt)

    def torch_fb() -> None:
        F.batch_norm(xt, rm, rv, wt, bt_, True).backward(dyt)

    return dict(zip(COLUMNS, (np_fwd, np_bwd, torch_fwd, torch_bwd, bngrad_fb, torch_fb)))


def _time(fn: Callable[[], Any], calls: int, samples: List[float]) -> None:
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)


def measure(shapes: List[tuple], dtypes: List[str], threads: int, rounds: int, burst: int
            ) -> Dict[str, Dict[str, float]]:
    """{"shape dtype": {column: median us}}."""
    cases = {f"{s} {d}": _contenders(s, d, threads) for s in shapes for d in dtypes}
    samples: Dict[str, Dict[str, List[float]]] = {k: {c: [] for c in COLUMNS} for k in cases}
    for contenders in cases.values():  # compile and warm up
        for fn in contenders.values():
            _time(fn, 3, [])
    for r in range(rounds):
        for key, contenders in cases.items():
            names = COLUMNS[r % len(COLUMNS):] + COLUMNS[:r % len(COLUMNS)]  # rotated order
            for name in names:
                _time(contenders[name], burst, samples[key][name])
    return {key: {c: statistics.median(v) * 1e6 for c, v in by.items()}
            for key, by in samples.items()}


def table(result: Dict[str, Dict[str, float]],
          baseline: Optional[Dict[str, Dict[str, float]]] = None) -> str:
    head = ["case"]
    for c in COLUMNS:
        head += [c] if baseline is None or c.startswith(("torch", "PyTorch")) else [
            f"{c} before", f"{c} after"]
    head.append("bngrad.torch / PyTorch")
    rows = [head, ["---"] * len(head)]
    for key, by in result.items():
        row = [key]
        for c in COLUMNS:
            if baseline is not None and not c.startswith(("torch", "PyTorch")):
                before = baseline.get(key, {}).get(c)
                row.append("-" if before is None else f"{before:.0f}")
            row.append(f"{by[c]:.0f}")
        row.append(f"{by['bngrad.torch f+b'] / by['PyTorch f+b']:.2f}")
        rows.append(row)
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def threshold(threads: int, rounds: int = 40, burst: int = 5) -> List[str]:
    """Where a parallel launch starts to pay: the same calls (backward, forward of (N, 64, 8, 8)
    float32, N doubling) forced serial and forced parallel, interleaved, with the pool hot
    and right after a PyTorch operator (whose OpenMP team is then still spinning). Returns
    report lines ending with the serial_elements they imply: the first size where parallel
    wins in every condition, times (threads - 1) / threads (kernels._plan.runs_serial)."""
    from bngrad import kernels
    rng = np.random.default_rng(0)
    sizes = [(n, 64, 8, 8) for n in (4, 8, 16, 32, 64, 128, 256)]
    arrays = {s: (rng.standard_normal(s, dtype=np.float32), np.empty(s, np.float32))
              for s in sizes}

    def backward(shape: tuple) -> None:
        x, out = arrays[shape]
        bngrad.batch_norm_backward(x, x, None, None, None, None, None, True,
                                   num_threads=threads, out=out)

    def forward(shape: tuple) -> None:
        x, out = arrays[shape]
        bngrad.batch_norm_forward(x, num_threads=threads, out=out)

    conditions: Dict[str, Callable[[], Any]] = {"hot": lambda: None}
    try:
        import torch
        torch.set_num_threads(threads)
        a = torch.randn(1 << 18)
        conditions["after torch"] = lambda: a.mul_(1.0)
    except ImportError:
        pass
    samples: Dict[tuple, List[float]] = {}
    for _ in range(rounds):
        for shape in sizes:
            for op in (backward, forward):
                for cond, before in conditions.items():
                    for limit in (1 << 62, 0):  # serial, parallel
                        with kernels.override(serial_elements=limit):
                            for _ in range(burst):
                                before()
                                t = time.perf_counter()
                                op(shape)
                                samples.setdefault((shape, op.__name__, cond, limit), []).append(
                                    time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
    lines = ["elements | " + " | ".join(f"{op} {cond} serial/parallel us"
                                        for op in ("backward", "forward") for cond in conditions)]
    pays = None
    for shape in sizes:
        cells, wins = [], True
        for op in ("backward", "forward"):
            for cond in conditions:
                ser, par = med[(shape, op, cond, 1 << 62)], med[(shape, op, cond, 0)]
                cells.append(f"{ser:.0f}/{par:.0f}")
                wins = wins and par < ser
        size = int(np.prod(shape))
        if wins and pays is None:
            pays = size
        lines.append(f"{size} | " + " | ".join(cells))
    if pays is None:
        lines.append(f"parallel never won in every condition up to {int(np.prod(sizes[-1]))}")
    else:
        lines.append(f"parallel wins from {pays} elements: implied serial_elements "
                     f"{pays * (threads - 1) // threads}")
    return lines


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", type=_shape, default=SHAPES,
                        help="N,C,H,W ... (default: the issue's four)")
    parser.add_argument("--dtypes", nargs="*", default=DTYPES, choices=DTYPES)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--burst", type=int, default=20, help="calls per contender and round")
    parser.add_argument("--json", help="save the medians here")
    parser.add_argument("--baseline", help="a --json file of an earlier run: before/after")
    parser.add_argument("--threshold", action="store_true",
                        help="measure where parallel launches pay (Config.serial_elements)")
    args = parser.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"bngrad {bngrad.__version__} from {os.path.dirname(bngrad.__file__)}, torch "
          f"{torch.__version__}, {args.threads} threads, load average {load:.2f}")
    if args.threshold:
        print("\n".join(threshold(args.threads)))
        return
    result = measure(args.shapes, args.dtypes, args.threads, args.rounds, args.burst)
    baseline = None
    if args.baseline:
        with open(args.baseline) as f:
            baseline = json.load(f)["result"]
    print("median us per call")
    print(table(result, baseline))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "load": load, "result": result}, f, indent=1)


if __name__ == "__main__":
    main()
