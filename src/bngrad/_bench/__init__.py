"""The benchmark behind ``bngrad bench``: cases, contenders, timing, the memory floor, results.

Private: the command line and its JSON are the stable interface; these names may change.

What is measured, per case (one array shape, dtype and memory layout), all in one process with
the same thread count for every contender:

- **bngrad**: :func:`bngrad.batch_norm_backward` (training mode, all three gradients);
- **torch**: ``torch.ops.aten.native_batch_norm_backward`` on tensors sharing the same memory,
  after ``torch.set_num_threads(threads)`` (skipped, with the reason, when PyTorch is missing);
- **reference**: :func:`bngrad.reference.batch_norm_backward`, the float64 NumPy oracle
  (single-threaded and slow: only timed up to a size cap);
- **floor**: one fused parallel elementwise pass ``dx = a[c]*dy + b[c]*x`` over arrays of the
  same shape, dtype and thread count, in the input's memory layout, allocating its output like
  every other contender does. No batch-norm backward that returns a new grad_input can beat
  it: it must read x and dy and write dx too;
- **floor_in_place**: the same pass into one output allocated up front, so the difference to
  ``floor`` is what fresh memory costs (page faults, the kernel zeroing pages);
- **bngrad_out**: bngrad into ``out=``, one grad_input allocated up front, reused alike: its
  ratio to floor_in_place is bngrad's distance to the floor without the fresh pages;
- **torch_compile** (only with ``Options.torch_compile``): the torch contender's function
  through ``torch.compile`` (inductor, static shapes), compiled before the timings (skipped,
  with the reason, without PyTorch or a C++ compiler, or when compiling fails).

Contenders are interleaved within each repeat (and their order rotated) so that the machine's
noise falls on all of them alike; figures are medians. Nothing here prints:
``bngrad._cli_bench`` renders progress, tables and plots, and adds the command's flag names to
the errors raised here (which name the Python arguments: ``threads``, ``dtypes``, ...).

Modules, each on the ones above it:

- ``cases``: :class:`Case`, the suites, :func:`select_cases`;
- ``floor``: the floor kernels, :func:`make_floor`, :func:`floor_pass`;
- ``arrays``: :func:`make_arrays`, a case's random data in its layout;
- ``contenders``: what is timed;
- ``measure``: :class:`Timing`, calibration, cores busy, peak extra memory;
- ``results``: :class:`Options`, :class:`CaseResult`, :class:`SuiteResult` and JSON;
- ``machine``: machine information, other processes' load, the start-up probe;
- ``run``: :func:`run_case`, :func:`run_suite` and the checks of their options.
"""

from .arrays import make_arrays
from .cases import LAYOUTS, RESNET50_SHAPES, SUITES, Case, select_cases
from .floor import floor_pass, make_floor
from .machine import default_threads, measure_startup
from .measure import measure_extra_memory
from .results import Options, SuiteResult, geomean
from .run import check_repeat, check_threads, run_suite

# What `bngrad bench` (bngrad._cli_bench), tests/test_bench.py and benchmarks/README.md use.
__all__ = [
    "LAYOUTS", "RESNET50_SHAPES", "SUITES", "Case", "Options", "SuiteResult", "check_repeat",
    "check_threads", "default_threads", "floor_pass", "geomean", "make_arrays", "make_floor",
    "measure_extra_memory", "measure_startup", "run_suite", "select_cases",
]
