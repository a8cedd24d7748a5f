"""Real multi-process groups for the SyncBatchNorm tests: a launcher and the per-rank workers.

``start_group`` spawns ``world`` fresh Python processes with ``torch.multiprocessing``; each
joins a gloo process group on 127.0.0.1 (a free port, a short collective timeout), runs one
worker function from this module and sends its result back. Workers run many checks per
group, because starting a process and importing torch and Numba costs seconds. The parent
compares the results against bngrad.reference; workers only compute and record.

Nothing heavy is imported at module level: the parent (pytest) must not pick up the workers'
environment (one Numba/torch thread per rank, so that three ranks share two cores sanely).
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback
from typing import Any

import torch.multiprocessing as mp

PG_TIMEOUT_S = 6.0   # collective timeout of every test group: faults surface in seconds


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, worker: str, args: tuple, queue: Any) -> None:
    os.environ.update(NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        result = globals()[worker](rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        queue.put((rank, "error", traceback.format_exc()))
    # No destroy_process_group: after a deliberate fault the group is broken, and exiting
    # is all that is left to do. Every worker ends with a barrier when the group is healthy.
    os._exit(0)


class Group:
    """A running process group; ``results()`` waits for it (never longer than ``timeout``)."""

    def __init__(self, world: int, worker: str, *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.queue = ctx.SimpleQueue()
        port = free_port()
        self._results: Any = None
        self.procs = [ctx.Process(target=_entry, args=(r, world, port, worker, args, self.queue),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def results(self, timeout: float, expect_exit: dict[int, int] | None = None) -> list[Any]:
        """Each rank's result, in rank order; ranks listed in ``expect_exit`` {rank: exit code}
        are expected to die without a result. Raises AssertionError on any error or timeout."""
        if self._results is None:
            self._results = self._collect(timeout, expect_exit)
        return self._results

    def _collect(self, timeout: float, expect_exit: dict[int, int] | None) -> list[Any]:
        expect_exit = expect_exit or {}
        wanted = set(range(self.world)) - set(expect_exit)
        got: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        try:
            while wanted - set(got) - set(errors):
                if not self.queue.empty():
                    rank, status, value = self.queue.get()
                    (got if status == "ok" else errors)[rank] = value
                    continue
                silent = [r for r in wanted - set(got) - set(errors)
                          if self.procs[r].exitcode is not None]
                if silent:
                    time.sleep(0.2)  # a result may still be in the pipe
                    if self.queue.empty():
                        raise AssertionError(f"ranks {silent} exited without a result")
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"process group did not finish within {timeout} s (a hang); "
                        f"results from ranks {sorted(got)}")
                time.sleep(0.05)
            if errors:
                raise AssertionError("".join(f"worker failed on rank {r}:\n{e}\n"
                                             for r, e in sorted(errors.items())))
            for rank, code in expect_exit.items():
                self.procs[rank].join(max(1.0, deadline - time.monotonic()))
                assert self.procs[rank].exitcode == code, (
                    f"rank {rank} exit code {self.procs[rank].exitcode}, expected {code}")
            return [got[r] for r in sorted(got)]
        finally:
            for p in self.procs:
                p.join(timeout=2.0)
                if p.is_alive():
                    p.kill()
                    p.join()


# ----------------------------------------------------------------------------- workers

def jobs(rank: int, world: int, todo: list) -> list:
    """Run several workers one after the other in the same group: [(name, args), ...]."""
    return [globals()[name](rank, world, *args) for name, args in todo]


def _arr(t: Any) -> Any:
    """Detached NumPy copy of a tensor, in its own dtype (bfloat16 via ml_dtypes)."""
    from bngrad.torch._convert import to_numpy
    if t is None:
        return None
    return to_numpy(t.detach()).copy() if t.is_floating_point() else t.detach().numpy().copy()


def _error(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__],
            "message": str(exc)}


def scenarios(rank: int, world: int, cases: list[dict]) -> dict:
    """Train every case's SyncBatchNorm for its steps on this rank's slice; record everything.

    A case: C, counts (local batch per rank), dtype, param_dtype, channels_last, affine,
    track_running_stats, momentum, eps, weight, bias, and per step global X and G (float64,
    already rounded to dtype by the parent). Eval mode runs on rank 0 only: if it
    communicated, it would meet the other ranks' barrier instead and fail.
    """
    import numpy as np
    import torch
    import torch.distributed as dist

    from bngrad.torch._convert import from_numpy, numpy_dtype
    from bngrad.torch.sync import SyncBatchNorm

    out = {"cases": []}
    for case in cases:
        dtype = getattr(torch, case["dtype"])
        pdtype = getattr(torch, case["param_dtype"])
        bn = SyncBatchNorm(case["C"], eps=case["eps"], momentum=case["momentum"],
                           affine=case["affine"], track_running_stats=case["track"], dtype=pdtype)
        if case["affine"]:
            with torch.no_grad():
                bn.weight.copy_(torch.from_numpy(case["weight"]))
                bn.bias.copy_(torch.from_numpy(case["bias"]))
        lo = sum(case["counts"][:rank])
        hi = lo + case["counts"][rank]

        fmt = torch.channels_last_3d if case["X"][0].ndim == 5 else torch.channels_last

        # Called only in this iteration (the steps below), so the loop variables it reads late
        # are this case's own: B023's late-binding hazard does not arise.
        def local(a: Any) -> Any:
            t = from_numpy(np.ascontiguousarray(a[lo:hi]).astype(numpy_dtype(dtype)))  # noqa: B023
            return t.contiguous(memory_format=fmt) if case["channels_last"] else t  # noqa: B023

        steps = []
        for X, G in zip(case["X"], case["G"]):
            x = local(X).requires_grad_(case["input_grad"])
            y = bn(x)
            y.backward(local(G))
            steps.append({
                "y": _arr(y), "grad_input": _arr(x.grad),
                "grad_weight": _arr(bn.weight.grad) if case["affine"] else None,
                "grad_bias": _arr(bn.bias.grad) if case["affine"] else None,
                "running_mean": _arr(bn.running_mean), "running_var": _arr(bn.running_var),
                "num_batches_tracked": None if bn.num_batches_tracked is None
                else int(bn.num_batches_tracked),
                "y_channels_last": y.is_contiguous(memory_format=fmt),
                "gi_channels_last": x.grad is not None
                and x.grad.is_contiguous(memory_format=fmt),
            })
            if case["affine"]:
                bn.weight.grad = bn.bias.grad = None
        rec = {"steps": steps}
        if rank == 0 and case["track"]:
            bn.eval()
            with torch.no_grad():
                rec["eval_y"] = _arr(bn(local(case["X"][0])))
        dist.barrier()
        rec["state_dict_keys"] = list(bn.state_dict())
        out["cases"].append(rec)

    # A group of one rank is the plain layer: no communication, local statistics.
    singles = [dist.new_group([r]) for r in range(world)]
    case = cases[0]
    bn = SyncBatchNorm(case["C"], process_group=singles[rank], dtype=torch.float64)
    lo = sum(case["counts"][:rank])
    x = torch.from_numpy(case["X"][0][lo:lo + case["counts"][rank]].copy())
    out["single"] = {"y": _arr(bn(x)) if x.shape[0] > 1 else None,
                     "running_mean": _arr(bn.running_mean)}
    dist.barrier()
    return out


def make_cnn(seed: int = 0) -> Any:
    """A small float64 CNN with two BatchNorm2d layers and one BatchNorm1d."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
        nn.Conv2d(6, 4, 3, stride=2), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Flatten(), nn.Linear(4 * 3 * 3, 5), nn.BatchNorm1d(5), nn.Linear(5, 2),
    ).double()


def train_cnn(model: Any, batches: list, lr: float = 0.1) -> Any:
    """SGD on mean-squared error, one step per (x, target) batch; returns the model."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, target in batches:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(target))
        loss.backward()
        opt.step()
    return model


def ddp_cnn(rank: int, world: int, batches: list) -> dict:
    """The CNN, converted to SyncBatchNorm, trained under DDP on this rank's equal share."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from bngrad.torch.sync import SyncBatchNorm

    model = SyncBatchNorm.convert_sync_batchnorm(make_cnn())
    n_sync = sum(isinstance(m, SyncBatchNorm) for m in model.modules())
    ddp = DistributedDataParallel(model)
    share = len(batches[0][0]) // world
    sl = slice(rank * share, (rank + 1) * share)
    train_cnn(ddp, [(x[sl], t[sl]) for x, t in batches])
    dist.barrier()
    return {"n_sync": n_sync,
            "state": {k: _arr(v) for k, v in model.state_dict().items()}}


def channel_mismatch_then_hang(rank: int, world: int) -> dict:
    """Ranks build layers with different C; then rank 1 stalls past the collective timeout."""
    import torch
    import torch.distributed as dist

    from bngrad.torch.sync import SyncBatchNorm

    c = 4 + rank
    rec = {}
    try:
        SyncBatchNorm(c, dtype=torch.float64)(torch.randn(3, c, 2, dtype=torch.float64))
        rec["mismatch"] = None
    except Exception as exc:  # noqa: BLE001
        rec["mismatch"] = _error(exc)
    dist.barrier()  # the group is still healthy after the channel check
    if rank == 1:
        time.sleep(PG_TIMEOUT_S + 4)  # alive, but never reaches the collective
        return rec
    bn = SyncBatchNorm(4, dtype=torch.float64)
    x = torch.randn(3, 4, 2, dtype=torch.float64)
    t0 = time.monotonic()
    try:
        bn(x)
        rec["hang"] = None
    except Exception as exc:  # noqa: BLE001
        rec["hang"] = _error(exc)
    rec["hang_seconds"] = time.monotonic() - t0
    return rec


def peer_dies(rank: int, world: int) -> dict:
    """Rank 1 dies after a first good step; rank 0 then runs forward and backward alone."""
    import torch
    import torch.distributed as dist

    from bngrad.torch.sync import SyncBatchNorm

    bn = SyncBatchNorm(4, dtype=torch.float64)
    bn(torch.randn(3, 4, 2, dtype=torch.float64)).sum().backward()
    dist.barrier()
    if rank == 1:
        os._exit(17)
    time.sleep(0.5)  # let the peer be gone
    rec = {}
    t0 = time.monotonic()
    try:
        bn(torch.randn(3, 4, 2, dtype=torch.float64))
        rec["forward"] = None
    except Exception as exc:  # noqa: BLE001
        rec["forward"] = _error(exc)
    rec["seconds"] = time.monotonic() - t0
    return rec


def edge_batches(rank: int, world: int) -> dict:
    """Global batches of one value per channel (an error on every rank) and of none."""
    import torch
    import torch.distributed as dist

    from bngrad.torch.sync import SyncBatchNorm

    rec = {}
    bn = SyncBatchNorm(3, dtype=torch.float64)
    try:
        bn(torch.randn(1 if rank == 0 else 0, 3, dtype=torch.float64))
        rec["one_value"] = None
    except Exception as exc:  # noqa: BLE001
        rec["one_value"] = _error(exc)
    dist.barrier()
    bn = SyncBatchNorm(3, dtype=torch.float64)
    x = torch.randn(0, 3, 4, dtype=torch.float64, requires_grad=True)
    y = bn(x)
    y.sum().backward()
    rec["empty"] = {"y_shape": tuple(y.shape), "grad_shape": tuple(x.grad.shape),
                    "running_mean": _arr(bn.running_mean), "running_var": _arr(bn.running_var),
                    "grad_weight": _arr(bn.weight.grad), "grad_bias": _arr(bn.bias.grad)}
    # no channels (a ZeroDivisionError on 2 ranks, found by hostile testing)
    x = torch.randn(4, 0, 2, dtype=torch.float64, requires_grad=True)
    y = SyncBatchNorm(0, dtype=torch.float64)(x)
    y.sum().backward()
    rec["no_channels"] = {"y_shape": tuple(y.shape), "grad_shape": tuple(x.grad.shape)}
    # torch's BatchNorm(bias=False): a weight but no bias
    bn = SyncBatchNorm.convert_sync_batchnorm(torch.nn.BatchNorm1d(3, bias=False).double())
    x = bias_free_input(rank).requires_grad_(True)
    y = bn(x)
    y.backward(torch.ones_like(y) + x.detach())
    rec["bias_free"] = {"y": _arr(y), "grad_input": _arr(x.grad),
                        "grad_weight": _arr(bn.weight.grad), "bias": bn.bias}
    dist.barrier()
    return rec


def bias_free_input(rank: int) -> Any:
    import torch
    return torch.randn(4 + rank, 3, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(100 + rank))
