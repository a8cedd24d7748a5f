"""The public functions: validate once -> plan the layout -> run the kernels.

Semantics follow PyTorch's ``torch.ops.aten.native_batch_norm_backward`` / ``native_batch_norm``
on the CPU (see README for where bngrad deliberately does better).
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from . import _calls, _dtypes
from . import _validate as check
from . import kernels
from ._layout import Plan, _Layout, _Shape, kernel_input, plan
from ._threads import resolve_num_threads

__all__ = [
    "batch_norm_backward",
    "batch_norm_backward_elemt",
    "batch_norm_backward_reduce",
    "batch_norm_forward",
    "batch_norm_moments",
    "explain",
]

Array = np.ndarray


def _f64(a: Optional[Array], n_channels: int, fill: float) -> Array:
    """``a`` in float64, or ``fill`` (1 or 0) in each channel."""
    if a is not None:
        return a.astype(np.float64)
    return np.ones(n_channels) if fill == 1.0 else np.zeros(n_channels)  # (faster than full)


def _count(input: Array, axis: int) -> int:
    """Elements per channel."""
    return input.size // input.shape[axis] if input.shape[axis] else 0


def _eval_stats(running_mean: Array, running_var: Array, eps: float) -> tuple[Array, Array]:
    """(mean, invstd) in float64 from the running statistics."""
    return running_mean.astype(np.float64), kernels.inv_std(running_var, eps, train=False)


def _first_elements(input: Array, axis: int) -> Array:
    """Each channel's first element, float64."""
    return input[_first_index(input.ndim, axis)].astype(np.float64)


@functools.lru_cache(maxsize=64)
def _first_index(ndim: int, axis: int) -> tuple:
    return tuple(slice(None) if i == axis else 0 for i in range(ndim))


def _moments(layout: Plan, input: Array, axis: int, count: int) -> tuple[Array, Array]:
    """Per-channel mean and biased variance of ``input`` (planned by ``layout``), float64.

    Both ways sum d = x - s and d**2 in float64 and take var = (sum d**2 - (sum d)**2/n)/n,
    whose relative error is about 1e-16 * (1 + (s - mean)**2 / var):
    - float64 data: two passes, s = the mean of the first pass (the corrected two-pass
      algorithm), so the error is ~1e-16 however far the data sits from zero;
    - other dtypes: one pass with s = each channel's first element. A data point is never
      more than sqrt(n) standard deviations from the mean, so the error stays below n*1e-16,
      far below float32's resolution, for one read of the data instead of two.
    """
    x = layout.x
    if input.dtype == np.float64:
        zeros = np.zeros(input.shape[axis])
        shift = kernels.reduce(layout.kernel, x, None, zeros)[0] / count
    else:
        shift = _first_elements(input, axis)
    # inf or NaN: 0, so that an infinite mean stays infinite (x - inf would make every sum NaN);
    # as the fused kernels' shifts (kernels.batchnorm._finite)
    shift[~np.isfinite(shift)] = 0.0
    sum_d, sum_d2 = kernels.reduce(layout.kernel, x, None, shift)
    # mean = shift + sum_d / count, var = max(sum_d2 - sum_d * sum_d / count, 0) / count
    return kernels.moments(shift, sum_d, sum_d2, count)


def _saved_invstd(invstd: Array, stat_dtype: np.dtype, eps: float) -> Array:
    """``invstd`` in the saved statistics' dtype. Beyond float32's range (a variance below
    ~1e-77 with an eps below that: eps 0) it is inf there, without NumPy's overflow warning (the
    API never warns); the check of eps first, since np.errstate costs more than the cast."""
    if eps > 1e-76 or stat_dtype == np.float64:
        return invstd.astype(stat_dtype)
    with np.errstate(over="ignore"):
        return invstd.astype(stat_dtype)


def _data_pair(grad_out: Any, input: Any, channel_axis: Any) -> tuple[Array, Array, int]:
    grad_out, input = check.data_pair(grad_out, input)
    return grad_out, input, check.channel_axis(channel_axis, input.ndim)


def _direct(known: Optional[_calls.Known], threads: int, out: Optional[Array],
            forward: bool) -> Optional[kernels.KernelPlan]:
    """A repeat call's kernel plan where its kernels run on views of the caller's arrays
    (nothing copied, ``out`` absent or dense in the layout's order), and, for a ``forward``,
    in the kernel call that also takes the moments (``KernelPlan.one_call``, or a fused
    path); else None. Such a call skips planning the layout and makes the views itself: the
    fixed cost of a call is mostly Python, and inside a model, where the kernels and the
    layers around them have evicted the caches, every Python step costs several times what
    it does in a loop (issue 12, benchmarks/results/2026-12-02-session20.txt); the kernels,
    and so the bits, are those of the general path."""
    if known is None or known.layout.copied or (
            out is not None and not out.transpose(known.layout.order).flags.c_contiguous):
        return None
    kernel = kernels.plan(_Shape(known.layout.canonical), threads)
    if forward and not (kernel.one_call or kernel.path in ("fused", "fused_short")):
        return None
    return kernel


def _output_view(out: Optional[Array], input: Array, layout: _Layout) -> tuple[Array, Array]:
    """(kernel view, result) of ``out`` (dense in ``layout``'s order) or of a new array in that
    order (as ``Plan.output`` where nothing is copied)."""
    if out is None:
        memory = np.empty(layout.memory_shape, dtype=input.dtype)
        out = memory.transpose(layout.inverse)
    else:
        memory = out.transpose(layout.order)
    return kernels.as_kernel_array(memory).reshape(layout.canonical), out


def batch_norm_moments(input: Any, *, channel_axis: int = 1, num_threads: Optional[int] = None
                       ) -> Tuple[Array, Array]:
    """Per-channel mean and biased variance, in float64.

    Parameters
    ----------
    input : ndarray, ndim >= 2, float64/float32/float16/bfloat16, any strides
    channel_axis : int
        Axis holding the channels (1 as in PyTorch; -1 for channels-last shaped arrays).
    num_threads : int, optional
        Threads to use (default: all). Results are identical for every thread count.

    Returns
    -------
    mean, var : ndarray of shape (C,), float64
        NaN for channels with no elements.
    """
    input = check.data_array("input", input)
    axis = check.channel_axis(channel_axis, input.ndim)
    threads = check.num_threads(num_threads)
    n_channels = input.shape[axis]
    count = _count(input, axis)
    if count == 0:
        return np.full(n_channels, np.nan), np.full(n_channels, np.nan)
    layout = plan(input, None, axis, resolve_num_threads(threads), chunked=True)
    with kernels.region(layout.kernel), kernels.thread_count(layout.kernel):
        return _moments(layout, input, axis, count)


def batch_norm_forward(input: Any, weight: Any = None, bias: Any = None, running_mean: Any = None,
                       running_var: Any = None, train: bool = True, momentum: float = 0.1,
                       eps: float = 1e-5, *, channel_axis: int = 1,
                       num_threads: Optional[int] = None, out: Optional[Array] = None
                       ) -> Tuple[Array, Array, Array]:
    """Batch-norm forward, as ``torch.ops.aten.native_batch_norm``.

    The argument order is ``native_batch_norm``'s, (input, weight, bias, running_mean,
    running_var), **not** ``F.batch_norm``'s (input, running_mean, running_var, weight, bias),
    which :func:`bngrad.torch.batch_norm` follows. All four vectors have shape (C,), so a
    swapped order cannot be seen from shapes; pass them by keyword when in doubt. A negative
    ``running_var`` entry (a bias in the variance's place) raises.

    Parameters
    ----------
    input : ndarray, ndim >= 2, float64/float32/float16/bfloat16, any strides
    weight, bias : ndarray (C,), optional
        Affine parameters (None: 1 and 0). Input's dtype; for half inputs also float32 or
        float64 (each may be either).
    running_mean, running_var : ndarray (C,), optional
        Updated in place in train mode: ``r = (1 - momentum)*r + momentum*stat``, with the
        unbiased variance. Required in eval mode, where they normalise the input.
        ``running_var`` must not be negative (NaN is accepted, as PyTorch produces it).
    train : bool
        Normalise with the batch statistics (True) or the running ones (False).
    momentum, eps : float
    channel_axis : int
        Axis holding the channels (default 1).
    num_threads : int, optional
        Threads to use (default: all). Results are identical for every thread count.
    out : ndarray, optional
        Buffer for the output (input's shape and dtype); it may be input itself. A wrong
        shape is an ArgumentValueError, a wrong dtype an ArgumentTypeError.

    Returns
    -------
    output : ndarray
        ``out`` if given; else input's shape and dtype, in input's axis order when input is
        dense in some order.
    save_mean, save_invstd : ndarray (C,)
        Batch mean and 1/sqrt(var + eps) in train mode (float32 for float16/bfloat16 inputs,
        else input's dtype); empty arrays in eval mode, as in PyTorch.
    """
    return _forward(input, weight, bias, running_mean, running_var, train, momentum, eps,
                    channel_axis, num_threads, out)[:3]


def _forward(input: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any,
             train: Any, momentum: Any, eps: Any, channel_axis: Any, num_threads: Any,
             out: Optional[Array], side_input: Optional[Array] = None,
             relu: Optional[str] = None) -> Tuple[Array, Array, Array, Optional[Array]]:
    """batch_norm_forward, and the operands of bngrad.fused's variant, in its normalize pass:
    ``side_input`` (input's shape and dtype, any layout, checked by the caller) is added, and
    with ``relu`` ("bytes" or "bits", the mask's format) the ReLU is applied and its mask
    written. Returns (output, save_mean, save_invstd, mask): mask, for "bytes", is uint8 (1:
    the output passes) of input's shape laid out in the kernels' memory order (input's, or C
    order); for "bits", 1-D uint8, one bit per element in that memory order (kernels'
    docstring); else None."""
    # (side_input and relu, checked by bngrad.fused, change nothing that is remembered)
    signature = _calls.forward_signature(input, weight, bias, running_mean, running_var, train,
                                         channel_axis)
    known = _calls.find(signature)
    if known is None:  # every check (a call of this signature that passes them is remembered)
        input = check.data_array("input", input)
        axis = check.channel_axis(channel_axis, input.ndim)
        train = check.boolean("train", train)
        weight = check.param_vector("weight", weight, input, axis)
        bias = check.param_vector("bias", bias, input, axis)
        running_mean = check.param_vector("running_mean", running_mean, input, axis)
        running_var = check.param_vector("running_var", running_var, input, axis)
        check.running_stats_for_eval(train, running_mean, running_var)
        spec, count = _dtypes.spec(input.dtype), _count(input, axis)
    else:  # the checks of values, below, remain
        axis, spec, count = known.axis, known.spec, known.elements
    eps = check.eps(eps)
    momentum = check.momentum(momentum)
    threads = check.num_threads(num_threads)
    out = check.out_array(out, input, None)
    check.running_var(running_var)
    if train:  # the running statistics are written in place
        check.running_stats_writable(running_mean, running_var)
    n_channels = input.shape[axis]
    stat_dtype, compute = spec.stat, spec.compute
    threads = resolve_num_threads(threads)

    scale_weight, shift_bias = _f64(weight, n_channels, 1.0), _f64(bias, n_channels, 0.0)
    plain = side_input is None and relu is None
    kernel = _direct(known, threads, out, forward=True) if plain and train and count else None
    if kernel is not None and known is not None:  # views and the kernels' calls
        with kernels.region(kernel), kernels.thread_count(kernel):
            x = kernel_input(input, known.layout)
            out_kernel, output = _output_view(out, input, known.layout)
            fused = kernels.forward_train(kernel, x, out_kernel, scale_weight, shift_bias, eps,
                                          count, compute)
            assert fused is not None  # (a one-call or fused plan: _direct)
            mean, var, invstd = fused
            kernels.update_running_stats(running_mean, running_var, mean, var, momentum, count)
        return output, mean.astype(stat_dtype), _saved_invstd(invstd, stat_dtype, eps), None
    layout = plan(input, None, axis, threads, chunked=plain,
                  layout=None if known is None else known.layout)
    if known is None:
        _calls.remember(signature, _calls.Known(axis, count, spec, None, layout.layout))
    # inf data gives NaN, as in torch, and no warning: the kernels never warn (no errstate here)
    with kernels.region(layout.kernel), kernels.thread_count(layout.kernel):
        out_kernel, output = layout.output(input.shape, input.dtype, out)
        z = None if side_input is None else layout.canonical(side_input)
        mask_kernel: kernels.Aux = None
        mask: Optional[Array] = None
        if relu == "bits":  # the mask selects the ReLU in the kernels
            mask = np.zeros(-(-input.size // 8), np.uint8)
            mask_kernel = (mask, 0)
        elif relu is not None:
            mask_kernel, mask = layout.empty_output(input.shape, np.dtype(np.uint8))
        fused = None  # (mean, var, invstd) where one kernel wrote them and the output
        if train:
            if count == 0:
                mean, var = np.full(n_channels, np.nan), np.full(n_channels, np.nan)
            else:
                fused = kernels.forward_train(layout.kernel, layout.x, out_kernel, scale_weight,
                                              shift_bias, eps, count, compute, z, mask_kernel)
                mean, var = fused[:2] if fused is not None else _moments(layout, input, axis,
                                                                         count)
            if count > 0:
                kernels.update_running_stats(running_mean, running_var, mean, var, momentum,
                                             count)
        else:  # normalised with the running statistics (as _eval_stats)
            mean, var = running_mean.astype(np.float64), running_var.astype(np.float64)
        if fused is not None:
            invstd = fused[2]
        else:
            invstd, coef = kernels.normalize_coefficients(mean, var, eps, scale_weight,
                                                          shift_bias, compute, train)
            if input.size:
                kernels.elementwise(layout.kernel, out_kernel, coef, x=layout.x, z=z,
                                    aux=mask_kernel)
    output = layout.finish_output(output, out)

    if train:
        return output, mean.astype(stat_dtype), _saved_invstd(invstd, stat_dtype, eps), mask
    return output, np.empty(0, dtype=stat_dtype), np.empty(0, dtype=stat_dtype), mask


def batch_norm_backward(grad_out: Any, input: Any, weight: Any = None, running_mean: Any = None,
                        running_var: Any = None, save_mean: Any = None, save_invstd: Any = None,
                        train: bool = True, eps: float = 1e-5,
                        output_mask: Sequence[bool] = (True, True, True), *,
                        channel_axis: int = 1, num_threads: Optional[int] = None,
                        out: Optional[Array] = None
                        ) -> Tuple[Optional[Array], Optional[Array], Optional[Array]]:
    """Gradients of batch norm, as ``torch.ops.aten.native_batch_norm_backward``.

    The argument order is ``native_batch_norm_backward``'s: (grad_out, input, weight,
    running_mean, running_var, save_mean, save_invstd, ...). Like :func:`batch_norm_forward`,
    and unlike ``F.batch_norm``, the weight comes before the running statistics.

    Parameters
    ----------
    grad_out, input : ndarray, same shape and dtype, ndim >= 2, any strides
        float64, float32, float16 or bfloat16 (ml_dtypes).
    weight : ndarray (C,), optional
        Scale (gamma); None means 1.
    running_mean, running_var : ndarray (C,), optional
        Used in eval mode (``train=False``), where they are required. ``running_var`` must
        not be negative.
    save_mean, save_invstd : ndarray (C,), optional
        Batch statistics from the forward pass, used in train mode. Give both or neither:
        if both are None (or empty, as an eval-mode forward returns them) they are computed
        from input (biased variance, eps), where PyTorch would fail; one alone raises.
    train : bool
    eps : float
        Used with running_var in eval mode, and when the statistics are computed here.
    output_mask : three bools
        Which of (grad_input, grad_weight, grad_bias) to compute; the others come back None.
    channel_axis : int
        Axis holding the channels (default 1).
    num_threads : int, optional
        Threads to use (default: all). Results are identical for every thread count.
    out : ndarray, optional
        Buffer for grad_input (input's shape and dtype). It may be grad_out or input itself
        (in place), but must not partially overlap them. Reusing a buffer also saves the
        operating system's cost of handing out fresh pages for every call.

    Returns
    -------
    grad_input : ndarray or None
        ``out`` if given; else a new array of input's shape and dtype, in input's axis order
        when input is dense in some order.
    grad_weight, grad_bias : ndarray (C,) or None
        The weight's dtype if a weight is given; else float32 for a float16/bfloat16 input
        with float32 statistics (mixed precision); else input's dtype.
    """
    return _backward(grad_out, input, weight, running_mean, running_var, save_mean,
                     save_invstd, train, eps, output_mask, channel_axis, num_threads, out)[:3]


def _backward(grad_out: Any, input: Any, weight: Any, running_mean: Any, running_var: Any,
              save_mean: Any, save_invstd: Any, train: Any, eps: Any, output_mask: Any,
              channel_axis: Any, num_threads: Any, out: Optional[Array],
              relu: Optional[Array] = None, relu_bits: Optional[Array] = None,
              grad_side: bool = False
              ) -> Tuple[Optional[Array], Optional[Array], Optional[Array], Optional[Array]]:
    """batch_norm_backward, and the operands of bngrad.fused's variant: ``relu`` (the
    forward output, or mask bytes as uint8; input's shape, any layout) or ``relu_bits`` (the
    mask as bits in input's memory order, which is the kernels' canonical order: read by the
    kernels as they go), checked by the caller, masks grad_out in both passes; with
    ``grad_side`` the masked gradient g is also returned
    (grad_side_input, written by the pass that writes grad_input). Returns (grad_input,
    grad_weight, grad_bias, g or None)."""
    # (relu, relu_bits and grad_side, checked by bngrad.fused, change nothing remembered)
    signature = _calls.backward_signature(grad_out, input, weight, running_mean, running_var,
                                          save_mean, save_invstd, train, output_mask,
                                          channel_axis)
    known = _calls.find(signature)
    save_mean, save_invstd = check.save_stats(save_mean, save_invstd)
    if known is None:  # every check (a call of this signature that passes them is remembered)
        grad_out, input, axis = _data_pair(grad_out, input, channel_axis)
        train = check.boolean("train", train)
        mask = check.output_mask(output_mask)
        weight = check.param_vector("weight", weight, input, axis)
        running_mean = check.param_vector("running_mean", running_mean, input, axis)
        running_var = check.param_vector("running_var", running_var, input, axis)
        save_mean = check.param_vector("save_mean", save_mean, input, axis)
        save_invstd = check.param_vector("save_invstd", save_invstd, input, axis)
        check.running_stats_for_eval(train, running_mean, running_var)
        spec, count = _dtypes.spec(input.dtype), _count(input, axis)
        out_dtype = check.param_dtype(input.dtype, weight,
                                      (running_mean, running_var, save_mean, save_invstd))
    else:  # the checks of values, below, remain
        axis, spec, count, mask = known.axis, known.spec, known.elements, output_mask
        assert known.param_dtype is not None  # (a backward's)
        out_dtype = known.param_dtype
    eps = check.eps(eps)
    threads = check.num_threads(num_threads)
    out = check.out_array(out, input, grad_out) if mask[0] else None
    check.running_var(running_var)
    running = None if train else (running_mean, running_var)
    n_channels = input.shape[axis]
    w = _f64(weight, n_channels, 1.0)
    threads = resolve_num_threads(threads)

    plain = relu is None and relu_bits is None and not grad_side
    kernel = (_direct(known, threads, out, forward=False)
              if plain and train and mask[0] and count else None)
    if kernel is not None and known is not None and save_mean is not None and (
            save_invstd is not None):  # views and the kernels' calls
        with kernels.region(kernel), kernels.thread_count(kernel):
            x, dy = kernel_input(input, known.layout), kernel_input(grad_out, known.layout)
            out_kernel, result = _output_view(out, input, known.layout)
            invstd = save_invstd.astype(np.float64)
            sum_dy, sum_dy_xmu = kernels.backward_train(
                kernel, x, dy, out_kernel, save_mean.astype(np.float64), invstd, w, count,
                spec.compute)
        return (result, *kernels.param_grads(sum_dy, sum_dy_xmu, invstd, mask, out_dtype), None)
    # A backward with grad_input copies what must be copied into grad_input's buffer
    # (bngrad._layout), but for an out= that may share memory with the ReLU's record (y, or its
    # mask), which must not be written before it is read.
    record = relu if relu is not None else relu_bits
    layout = plan(input, grad_out, axis, threads, chunked=plain,
                  fusing=train and mask[0], layout=None if known is None else known.layout,
                  grad_in_output=mask[0] and (record is None or out is None
                                              or not np.may_share_memory(out, record)))
    if known is None:
        _calls.remember(signature, _calls.Known(axis, count, spec, out_dtype, layout.layout))
    with kernels.region(layout.kernel), kernels.thread_count(layout.kernel):
        y: kernels.Aux = None if relu is None else layout.canonical(relu)
        if relu_bits is not None:  # flat index 0: x's first element, in the mask's order
            y = (relu_bits, 0)
        side_kernel: Optional[Array] = None
        side: Optional[Array] = None
        if grad_side:
            side_kernel, side = layout.empty_output(input.shape, input.dtype)
        mean = invstd = None
        if count == 0:
            mean = invstd = np.zeros(n_channels)
        elif running is not None:  # eval mode
            mean, invstd = _eval_stats(*running, eps)
        elif save_mean is not None and save_invstd is not None:
            mean = save_mean.astype(np.float64)
            invstd = save_invstd.astype(np.float64)
        # grad_input's buffer after the statistics given (a copy may be made in it, Plan.output)
        # and before those of the data (input may be that copy)
        grad_input = None
        if mask[0]:
            grad_kernel, grad_input = layout.output(input.shape, input.dtype, out)
        if mean is None or invstd is None:
            mean, var = _moments(layout, input, axis, count)
            invstd = kernels.inv_std(var, eps, train=True)

        sums = None
        if count == 0:
            sums = (np.zeros(n_channels), np.zeros(n_channels))
        elif mask[0] and train:
            sums = kernels.backward_train(layout.kernel, layout.x, layout.grad, grad_kernel, mean,
                                          invstd, w, count, spec.compute,
                                          y, side_kernel)
        else:
            if mask[1] or mask[2]:
                sums = kernels.reduce(layout.kernel, layout.x, layout.grad, mean, y=y)
            if mask[0] or side_kernel is not None:
                coef = np.zeros((4, n_channels), dtype=spec.compute)
                coef[kernels.SCALE] = invstd * w
                if mask[0]:
                    kernels.elementwise(layout.kernel, grad_kernel, coef, dy=layout.grad, y=y,
                                        aux=side_kernel)
                elif side_kernel is not None:  # g alone: eval's pass, scale 1 (g*1 is exact)
                    coef[kernels.SCALE] = 1.0
                    kernels.elementwise(layout.kernel, side_kernel, coef, dy=layout.grad, y=y)

    if grad_input is not None:  # mask[0]
        grad_input = layout.finish_output(grad_input, out)
    grad_weight = grad_bias = None
    if mask[1] or mask[2]:
        assert sums is not None  # every branch above takes the sums when these are asked for
        grad_weight, grad_bias = kernels.param_grads(sums[0], sums[1], invstd, mask, out_dtype)
    return grad_input, grad_weight, grad_bias, side


def batch_norm_backward_reduce(grad_out: Any, input: Any, mean: Any, invstd: Any,
                               weight: Any = None, input_g: bool = True, weight_g: bool = True,
                               bias_g: bool = True, *, channel_axis: int = 1,
                               num_threads: Optional[int] = None
                               ) -> Tuple[Optional[Array], Optional[Array], Optional[Array],
                                          Optional[Array]]:
    """First half of the backward: the per-channel sums (as ``torch.batch_norm_backward_reduce``).

    Synchronized batch norm all-reduces ``sum_dy`` and ``sum_dy_xmu`` across processes, then
    calls :func:`batch_norm_backward_elemt` with the global count.

    Parameters
    ----------
    grad_out, input : ndarray, same shape and dtype, ndim >= 2, any strides
    mean, invstd : ndarray (C,)
        The statistics the forward pass normalised with.
    weight : ndarray (C,), optional
        Only its dtype matters here (it sets grad_weight/grad_bias's dtype).
    input_g, weight_g, bias_g : bool
        Whether to return (sum_dy, sum_dy_xmu), grad_weight and grad_bias.
    channel_axis, num_threads : as in :func:`batch_norm_backward`

    Returns
    -------
    sum_dy, sum_dy_xmu : ndarray (C,) or None
        In the dtype of ``mean``.
    grad_weight, grad_bias : ndarray (C,) or None
        ``sum_dy_xmu * invstd`` and ``sum_dy``, dtype as in :func:`batch_norm_backward`.
    """
    grad_out, input, axis = _data_pair(grad_out, input, channel_axis)
    n_channels = input.shape[axis]
    mean = check.required_param_vector("mean", mean, input, axis)
    invstd = check.required_param_vector("invstd", invstd, input, axis)
    weight = check.param_vector("weight", weight, input, axis)
    flags = [check.boolean(name, value) for name, value in
             (("input_g", input_g), ("weight_g", weight_g), ("bias_g", bias_g))]
    threads = check.num_threads(num_threads)
    out_dtype = check.param_dtype(input.dtype, weight, [mean, invstd])
    if input.size == 0:
        sum_dy, sum_dy_xmu = np.zeros(n_channels), np.zeros(n_channels)
    else:
        layout = plan(input, grad_out, axis, resolve_num_threads(threads), chunked=True)
        with kernels.region(layout.kernel), kernels.thread_count(layout.kernel):
            sum_dy, sum_dy_xmu = kernels.reduce(layout.kernel, layout.x, layout.grad,
                                                mean.astype(np.float64))
    grad_weight, grad_bias = kernels.param_grads(sum_dy, sum_dy_xmu, invstd.astype(np.float64),
                                                 flags, out_dtype)
    with np.errstate(over="ignore"):  # sums beyond the statistics' dtype: inf, no warning
        return (sum_dy.astype(mean.dtype) if flags[0] else None,
                sum_dy_xmu.astype(mean.dtype) if flags[0] else None, grad_weight, grad_bias)


def batch_norm_backward_elemt(grad_out: Any, input: Any, mean: Any, invstd: Any, weight: Any,
                              sum_dy: Any, sum_dy_xmu: Any, count: Any, *, channel_axis: int = 1,
                              num_threads: Optional[int] = None, out: Optional[Array] = None
                              ) -> Array:
    """Second half of the backward: grad_input from the (possibly all-reduced) sums.

    ``dx = (dy - sum_dy/count - (x - mean) * invstd**2 * sum_dy_xmu/count) * invstd * weight``

    Parameters
    ----------
    grad_out, input : ndarray, same shape and dtype, ndim >= 2, any strides
    mean, invstd : ndarray (C,)
    weight : ndarray (C,) or None
    sum_dy, sum_dy_xmu : ndarray (C,)
        From :func:`batch_norm_backward_reduce`, summed over all participants.
    count : int, float or array of per-rank counts
        Elements per channel over all participants: a number > 0, or the per-rank counts
        (PyTorch passes a tensor of them), each >= 0 (0 for an empty rank), summed. Bools,
        strings and negative counts raise.
    channel_axis, num_threads, out : as in :func:`batch_norm_backward`

    Returns
    -------
    grad_input : ndarray
        ``out`` if given; else input's shape and dtype, in input's axis order when input is
        dense in some order.
    """
    grad_out, input, axis = _data_pair(grad_out, input, channel_axis)
    n_channels = input.shape[axis]
    f64 = {name: check.required_param_vector(name, value, input, axis).astype(np.float64)
           for name, value in (("mean", mean), ("invstd", invstd), ("sum_dy", sum_dy),
                               ("sum_dy_xmu", sum_dy_xmu))}
    weight = check.param_vector("weight", weight, input, axis)
    total = check.count(count)
    threads = check.num_threads(num_threads)
    out = check.out_array(out, input, grad_out)
    layout = plan(input, grad_out, axis, resolve_num_threads(threads), chunked=True,
                  grad_in_output=True)
    # the coefficients first: making the output may copy grad_out into ``out``, which may hold
    # the weight (as batch_norm_backward reads it before writing)
    coef = kernels.train_coefficients(f64["sum_dy"], f64["sum_dy_xmu"], f64["mean"],
                                      f64["invstd"], _f64(weight, n_channels, 1.0), total,
                                      _dtypes.compute_dtype(input.dtype))
    with kernels.region(layout.kernel), kernels.thread_count(layout.kernel):
        grad_kernel, grad_input = layout.output(input.shape, input.dtype, out)
        if input.size:
            kernels.elementwise(layout.kernel, grad_kernel, coef, layout.x, layout.grad)
    return layout.finish_output(grad_input, out)


def explain(input: Any, grad_out: Any = None, *, channel_axis: int = 1,
            num_threads: Optional[int] = None) -> str:
    """How bngrad runs a call on these arrays: their canonical view, copies and kernel plan.

    The same plan serves every function called with the same arrays and threads (the
    training backward and forward fuse on ``path='fused'`` and ``'fused_short'``). Plans
    depend on the thread count only through fusing and through running serially ("(serial)":
    small calls and one thread, docs/internals.md), neither of which changes a bit.

    Parameters
    ----------
    input : ndarray
    grad_out : ndarray, optional
        As passed to a backward function (its layout decides whether it is copied).
    channel_axis, num_threads : as in :func:`batch_norm_backward`

    Returns
    -------
    str
        Several lines, for printing. Copies that the plan needs are made to find it out
        (those larger than ``kernels.Config.copy_chunk_bytes``, which the plain forward and
        backward make a chunk of rows at a time, are not made: "in chunks"). A backward that
        computes grad_input copies grad_out into grad_input's own buffer instead, whole.
    """
    if grad_out is None:
        input = check.data_array("input", input)
        axis = check.channel_axis(channel_axis, input.ndim)
    else:
        grad_out, input, axis = _data_pair(grad_out, input, channel_axis)
    threads = check.num_threads(num_threads)
    layout = plan(input, grad_out, axis, resolve_num_threads(threads), chunked=True)
    chunks = " (in chunks)" if not isinstance(layout.x, np.ndarray) or not isinstance(
        layout.dy, (np.ndarray, type(None))) else ""
    copied = [name + (" (into grad_input's buffer where grad_input is computed)"
                      if name == "grad_out" else "") for name in layout.copied]
    return (f"input {input.shape} {input.dtype.name}, channel axis {axis}: memory order "
            f"{layout.order}, kernel view {layout.x.shape} {layout.x.dtype.name}, copied: "
            f"{', '.join(copied) or 'nothing'}{chunks}\n{layout.kernel!r}")
