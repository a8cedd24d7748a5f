"""Communication volume and per-step overhead of bngrad.torch.SyncBatchNorm vs local batch norm.

Starts ``--world`` ranks on this machine (gloo on 127.0.0.1, ``--threads`` threads each) and,
per layer shape, times one training step (forward + backward) of

- ``local``: bngrad.torch.BatchNorm*d on the rank's own batch (no communication);
- ``sync``: bngrad.torch.SyncBatchNorm over all ranks;
- ``comm``: the two collectives of a sync step alone (all_gather of 2C+1 float64,
  all_reduce of 2C float64), on the same process group;
- ``compute``: the sync step's own arithmetic, its autograd function run on a group of this
  rank alone (collectives of one rank: next to free);
- ``torch``: torch.nn.BatchNorm*d, local, for scale.

All variants run interleaved in the same processes, after a barrier, and are reported as
medians on rank 0 and as ratios to ``local``. The bytes are counted at the torch.distributed
call (the tensors handed to all_gather / all_reduce), not computed from a formula.

    python benchmarks/sync_overhead.py --world 2 --threads 1 --repeat 30
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time

import torch.multiprocessing as mp

SHAPES = [(8, 32, 8, 8), (16, 64, 32, 32), (16, 256, 16, 16), (256, 1024)]


def _rank(rank: int, world: int, port: int, threads: int, repeat: int, queue) -> None:
    os.environ.update(NUMBA_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    import bngrad.torch as bt

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    sent = {"all_gather": 0, "all_reduce": 0, "calls": 0}
    real_gather, real_reduce = dist.all_gather, dist.all_reduce

    def counting_gather(parts, tensor, *a, **k):
        sent["all_gather"] += tensor.numel() * tensor.element_size()
        sent["calls"] += 1
        return real_gather(parts, tensor, *a, **k)

    def counting_reduce(tensor, *a, **k):
        sent["all_reduce"] += tensor.numel() * tensor.element_size()
        sent["calls"] += 1
        return real_reduce(tensor, *a, **k)

    from bngrad.torch.sync import _SyncBatchNormFunction

    alone = [dist.new_group([r]) for r in range(world)][rank]

    def make_variants(shape: tuple[int, ...]) -> dict:
        """The five timed steps for one layer shape, each closing over this call's tensors."""
        C = shape[1]
        torch.manual_seed(rank)
        x = torch.randn(shape).requires_grad_(True)
        g = torch.randn(shape)
        kind = {2: "1d", 4: "2d"}[len(shape)]
        layers = {
            "local": getattr(bt, f"BatchNorm{kind}")(C),
            "sync": bt.SyncBatchNorm(C),
            "torch": getattr(torch.nn, f"BatchNorm{kind}")(C),
        }
        gather_buf = torch.zeros(2 * C + 1, dtype=torch.float64)
        reduce_buf = torch.zeros(2, C, dtype=torch.float64)

        def comm() -> None:
            parts = [torch.empty_like(gather_buf) for _ in range(world)]
            real_gather(parts, gather_buf)
            real_reduce(reduce_buf)

        def step(layer):
            return lambda: layer(x).backward(g)

        solo = layers["sync"]

        def compute() -> None:
            _SyncBatchNormFunction.apply(x, solo.weight, solo.bias, solo.running_mean,
                                         solo.running_var, solo.eps, 0.1, alone, 1,
                                         "compute").backward(g)

        return {"local": step(layers["local"]), "sync": step(layers["sync"]),
                "comm": comm, "compute": compute, "torch": step(layers["torch"])}

    rows = []
    for shape in SHAPES:
        variants = make_variants(shape)
        for fn in variants.values():  # warm-up: JIT, the one-off channel check, caches
            for _ in range(3):
                fn()
        # bytes of one steady-state sync step, counted at the torch.distributed calls
        dist.all_gather, dist.all_reduce = counting_gather, counting_reduce
        sent.update(all_gather=0, all_reduce=0, calls=0)
        variants["sync"]()
        dist.all_gather, dist.all_reduce = real_gather, real_reduce
        volume = dict(sent)

        times = {name: [] for name in variants}
        for _ in range(repeat):
            for name, fn in variants.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(t) for name, t in times.items()}
        rows.append({"shape": shape, "C": shape[1], "volume": volume, "median_s": med})
    dist.barrier()
    queue.put((rank, rows))
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="threads per rank")
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args.threads, args.repeat,
                                              queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()

    print(f"world {args.world}, {args.threads} thread(s) per rank, gloo on 127.0.0.1, float32, "
          f"median of {args.repeat} steps (forward + backward) on rank 0")
    print(f"{'local shape':>18} {'bytes/rank/step':>16} {'calls':>5} {'local ms':>9} "
          f"{'sync ms':>8} {'sync/local':>10} {'compute/local':>13} {'comm/local':>10} "
          f"{'torch/local':>11}")
    for row in results[0]:
        m = {k: v * 1e3 for k, v in row["median_s"].items()}
        vol = row["volume"]
        print(f"{str(row['shape']):>18} {vol['all_gather'] + vol['all_reduce']:>16} "
              f"{vol['calls']:>5} {m['local']:>9.3f} {m['sync']:>8.3f} "
              f"{m['sync'] / m['local']:>10.2f} {m['compute'] / m['local']:>13.2f} "
              f"{m['comm'] / m['local']:>10.2f} "
              f"{m['torch'] / m['local']:>11.2f}")
        expected = 8 * ((2 * row["C"] + 1) + 2 * row["C"])
        assert vol["all_gather"] + vol["all_reduce"] == expected, (vol, expected)


if __name__ == "__main__":
    main()
