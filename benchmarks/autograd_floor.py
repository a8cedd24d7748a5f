"""What a layer costs PyTorch's autograd before any work: empty Functions, in C++ and Python.

Issue 12 asks for a fixed cost of at most 20 us per call on the eager PyTorch path. This
measures the floor any design meets, forward + backward of a tiny batch norm's arguments
(input (2, 4, 3, 3), weight, bias; the gradients accumulated into leaves, as in training):

- ``C++ empty Function``: a ``torch::autograd::Function`` whose forward and backward only
  allocate their outputs (``at::empty_like``), built here with
  ``torch.utils.cpp_extension.load_inline`` (needs a C++ compiler and ninja; about 40 s, once
  per build directory);
- ``Python empty Function``: the same as a ``torch.autograd.Function`` in Python;
- ``bngrad.torch``: ``bngrad.torch.functional.batch_norm`` (the eager path: a Python Function
  around the NumPy API);
- ``F.batch_norm``: PyTorch's own, kernels included.

Medians and minima in us over ``--rounds`` rounds of ``--inner`` calls, interleaved.

    .venv/bin/python benchmarks/autograd_floor.py
    .venv/bin/python benchmarks/autograd_floor.py --build-dir /tmp/autograd_floor
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

import bngrad.torch as bt

_SOURCE = r"""
#include <torch/extension.h>
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
struct EmptyBatchNorm : public torch::autograd::Function<EmptyBatchNorm> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor w,
                               torch::Tensor b) {
    ctx->save_for_backward({x, w});
    return at::empty_like(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto saved = ctx->get_saved_variables();
    return {at::empty_like(saved[0]), at::empty_like(saved[1]), at::empty_like(saved[1])};
  }
};
torch::Tensor empty_batch_norm(torch::Tensor x, torch::Tensor w, torch::Tensor b) {
  return EmptyBatchNorm::apply(x, w, b);
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("empty_batch_norm", &empty_batch_norm); }
"""


class _EmptyBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(w), torch.empty_like(w)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build-dir", default=os.path.join(tempfile.gettempdir(),
                                                            "bngrad_autograd_floor"))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--inner", type=int, default=500)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    from torch.utils.cpp_extension import load_inline
    os.makedirs(args.build_dir, exist_ok=True)
    t0 = time.perf_counter()
    ext = load_inline("bngrad_autograd_floor", cpp_sources=[_SOURCE],
                      build_directory=args.build_dir, extra_cflags=["-O2"])
    print(f"extension ready in {time.perf_counter() - t0:.1f} s")
    torch.set_num_threads(args.threads)
    x = torch.randn(2, 4, 3, 3, requires_grad=True)
    w, b = torch.ones(4, requires_grad=True), torch.zeros(4, requires_grad=True)
    running_mean, running_var, grad = torch.zeros(4), torch.ones(4), torch.randn(2, 4, 3, 3)
    variants = {
        "C++ empty Function": lambda: ext.empty_batch_norm(x, w, b).backward(grad),
        "Python empty Function": lambda: _EmptyBatchNorm.apply(x, w, b).backward(grad),
        "bngrad.torch": lambda: bt.functional.batch_norm(
            x, running_mean, running_var, w, b, True, 0.1, 1e-5).backward(grad),
        "F.batch_norm": lambda: F.batch_norm(
            x, running_mean, running_var, w, b, True, 0.1, 1e-5).backward(grad),
    }
    times: dict = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            for _ in range(args.inner // 10):
                fn()
            t0 = time.perf_counter()
            for _ in range(args.inner):
                fn()
            times[name].append((time.perf_counter() - t0) / args.inner * 1e6)
    print(f"forward + backward, us per call ({args.threads} threads): median / min")
    for name, t in times.items():
        print(f"  {name:<24}{statistics.median(t):8.1f} {min(t):8.1f}")


if __name__ == "__main__":
    main()
