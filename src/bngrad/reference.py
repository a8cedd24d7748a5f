"""The oracle: batch-norm forward and backward in float64 NumPy, the maths written plainly.

Every fast path in bngrad is tested against these functions, and these functions are
tested against PyTorch in float64. They take the same arguments as the public API
(without ``num_threads``), trust their inputs, and always return float64 arrays
(``None`` for outputs that were not asked for). Speed is not a goal here: clarity is.

Per channel c, over the M elements of that channel::

    sum_dy     = sum(dy)
    sum_dy_xmu = sum(dy * (x - mean))
    train: dx = (dy - sum_dy / M - (x - mean) * sum_dy_xmu * invstd**2 / M) * invstd * w
    eval:  dx = dy * invstd * w,  with mean = running_mean, invstd = 1 / sqrt(running_var + eps)
    grad_weight = sum_dy_xmu * invstd
    grad_bias   = sum_dy

Batch norm fused with a residual add and a ReLU (``batch_norm_relu_forward`` / ``_backward``)::

    forward:  y = act(w * (x - mean) * invstd + b + z),  act = ReLU or none, z the side input
    backward: g = 0 where y <= 0 (ReLU), else dy   (PyTorch's threshold_backward(dy, y, 0))
              grad_input, grad_weight, grad_bias = batch norm's backward of g
              grad_side_input = g
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "batch_norm_backward",
    "batch_norm_backward_elemt",
    "batch_norm_backward_reduce",
    "batch_norm_forward",
    "batch_norm_moments",
    "batch_norm_relu_backward",
    "batch_norm_relu_forward",
]


def _f64(a):
    return None if a is None else np.asarray(a).astype(np.float64)


def _channels_last(a, channel_axis):
    """float64 copy of ``a`` with the channel axis moved last: shape (..., C)."""
    return np.moveaxis(_f64(a), channel_axis, -1)


def _restore(a, channel_axis):
    return np.moveaxis(a, -1, channel_axis)


def _reduce_axes(ndim):
    return tuple(range(ndim - 1))


def batch_norm_moments(input, *, channel_axis=1):
    """Per-channel mean and biased variance, two-pass, in float64 (NaN for empty channels)."""
    x = _channels_last(input, channel_axis)
    axes = _reduce_axes(x.ndim)
    count = x.size // x.shape[-1] if x.shape[-1] else 0
    if count == 0:
        return np.full(x.shape[-1], np.nan), np.full(x.shape[-1], np.nan)
    mean = x.sum(axis=axes) / count
    var = ((x - mean) ** 2).sum(axis=axes) / count
    return mean, var


def _invstd(var, eps, train):
    """1 / sqrt(var + eps); where var + eps is 0 (var and eps both 0): 0 in training (PyTorch's
    InvStd, so the channel's output is its bias), inf in eval (1 / sqrt(running_var + eps))."""
    v = var + eps
    with np.errstate(divide="ignore"):
        invstd = 1.0 / np.sqrt(v)
    return np.where(v == 0, 0.0, invstd) if train else invstd


def _stats(input, running_mean, running_var, save_mean, save_invstd, train, eps, channel_axis):
    if train:
        if save_mean is None or save_invstd is None:
            mean, var = batch_norm_moments(input, channel_axis=channel_axis)
            return mean, _invstd(var, eps, True)
        return _f64(save_mean), _f64(save_invstd)
    return _f64(running_mean), _invstd(_f64(running_var), eps, False)


def batch_norm_backward_reduce(grad_out, input, mean, invstd, weight=None,
                               input_g=True, weight_g=True, bias_g=True, *, channel_axis=1):
    """Returns (sum_dy, sum_dy_xmu, grad_weight, grad_bias); masked-off entries are None."""
    dy = _channels_last(grad_out, channel_axis)
    x = _channels_last(input, channel_axis)
    mean, invstd = _f64(mean), _f64(invstd)
    axes = _reduce_axes(x.ndim)
    sum_dy = dy.sum(axis=axes)
    sum_dy_xmu = (dy * (x - mean)).sum(axis=axes)
    return (sum_dy if input_g else None,
            sum_dy_xmu if input_g else None,
            sum_dy_xmu * invstd if weight_g else None,
            sum_dy if bias_g else None)


def batch_norm_backward_elemt(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count,
                              *, channel_axis=1):
    """grad_input from the (possibly all-reduced) sums; ``count`` = elements per channel in all."""
    dy = _channels_last(grad_out, channel_axis)
    x = _channels_last(input, channel_axis)
    mean, invstd = _f64(mean), _f64(invstd)
    w = np.ones_like(mean) if weight is None else _f64(weight)
    count = float(np.sum(count))
    mean_dy = _f64(sum_dy) / count
    mean_dy_xmu = _f64(sum_dy_xmu) / count
    dx = (dy - mean_dy - (x - mean) * mean_dy_xmu * invstd ** 2) * invstd * w
    return _restore(dx, channel_axis)


def batch_norm_backward(grad_out, input, weight=None, running_mean=None, running_var=None,
                        save_mean=None, save_invstd=None, train=True, eps=1e-5,
                        output_mask=(True, True, True), *, channel_axis=1):
    """What ``torch.ops.aten.native_batch_norm_backward`` computes, in float64."""
    x = _channels_last(input, channel_axis)
    n_channels = x.shape[-1]
    count = x.size // n_channels if n_channels else 0
    mean, invstd = _stats(input, running_mean, running_var, save_mean, save_invstd,
                          train, eps, channel_axis)
    if count == 0:  # no elements: zero gradients, whatever the (undefined) statistics
        mean = invstd = np.zeros(n_channels)
    sum_dy, sum_dy_xmu, grad_weight, grad_bias = batch_norm_backward_reduce(
        grad_out, input, mean, invstd, weight, True, output_mask[1], output_mask[2],
        channel_axis=channel_axis)
    grad_input = None
    if output_mask[0]:
        if not train:
            dy = _channels_last(grad_out, channel_axis)
            w = np.ones(n_channels) if weight is None else _f64(weight)
            grad_input = _restore(dy * invstd * w, channel_axis)
        elif count == 0:
            grad_input = np.zeros(np.shape(input))
        else:
            grad_input = batch_norm_backward_elemt(grad_out, input, mean, invstd, weight,
                                                   sum_dy, sum_dy_xmu, count,
                                                   channel_axis=channel_axis)
    return grad_input, grad_weight, grad_bias


def batch_norm_forward(input, weight=None, bias=None, running_mean=None, running_var=None,
                       train=True, momentum=0.1, eps=1e-5, *, channel_axis=1):
    """What ``torch.ops.aten.native_batch_norm`` computes, in float64.

    Returns (output, save_mean, save_invstd, new_running_mean, new_running_var); the last two
    are None when running stats were not given or in eval mode. An empty batch gives NaN
    statistics and leaves the running statistics as they were. Unlike the public API, nothing
    is updated in place: the oracle has no side effects.
    """
    x = _channels_last(input, channel_axis)
    n_channels = x.shape[-1]
    w = np.ones(n_channels) if weight is None else _f64(weight)
    b = np.zeros(n_channels) if bias is None else _f64(bias)
    new_rm = new_rv = None
    if train:
        mean, var = batch_norm_moments(input, channel_axis=channel_axis)
        invstd = _invstd(var, eps, True)
        count = x.size // n_channels if n_channels else 0
        # An empty batch leaves the running statistics as they were.
        if running_mean is not None:
            new_rm = _f64(running_mean)
            if count > 0:
                new_rm = (1 - momentum) * new_rm + momentum * mean
        if running_var is not None:
            new_rv = _f64(running_var)
            if count > 0:
                # count 1: 0/0, NaN, as in PyTorch
                unbiased = var * count / (count - 1) if count > 1 else np.full(n_channels, np.nan)
                new_rv = (1 - momentum) * new_rv + momentum * unbiased
        save_mean, save_invstd = mean, invstd
    else:
        mean = _f64(running_mean)
        invstd = _invstd(_f64(running_var), eps, False)
        save_mean = save_invstd = np.zeros(0)
    output = _restore((x - mean) * invstd * w + b, channel_axis)
    return output, save_mean, save_invstd, new_rm, new_rv


def batch_norm_relu_forward(input, weight=None, bias=None, running_mean=None, running_var=None,
                            train=True, momentum=0.1, eps=1e-5, *, side_input=None,
                            activation="relu", channel_axis=1):
    """Batch norm, plus the side input, then the activation, in float64.

    Returns (output, save_mean, save_invstd, new_running_mean, new_running_var, relu_mask):
    the first five as :func:`batch_norm_forward`'s, with ``output = act(bn + side_input)``;
    ``relu_mask`` is a bool array of input's shape, True where the ReLU passes the gradient
    (``not output <= 0``: positive, or NaN), None for ``activation="none"``.
    """
    output, save_mean, save_invstd, new_rm, new_rv = batch_norm_forward(
        input, weight, bias, running_mean, running_var, train, momentum, eps,
        channel_axis=channel_axis)
    if side_input is not None:
        output = output + _f64(side_input)
    relu_mask = None
    if activation == "relu":
        relu_mask = ~(output <= 0)
        output = np.where(relu_mask, output, 0.0)
    return output, save_mean, save_invstd, new_rm, new_rv, relu_mask


def batch_norm_relu_backward(grad_out, input, weight=None, running_mean=None, running_var=None,
                             save_mean=None, save_invstd=None, train=True, eps=1e-5,
                             output_mask=(True, True, True, True), *, output=None,
                             relu_mask=None, activation="relu", channel_axis=1):
    """Gradients of :func:`batch_norm_relu_forward`, in float64.

    With ``activation="relu"``, give the forward's ``output`` or ``relu_mask`` (a bool array
    of input's shape, True where the gradient passes). Returns (grad_input, grad_weight,
    grad_bias, grad_side_input); None where ``output_mask`` is False.
    """
    g = _f64(grad_out)
    if activation == "relu":
        passes = ~(_f64(output) <= 0) if relu_mask is None else np.asarray(relu_mask, bool)
        g = np.where(passes, g, 0.0)
    grad_input, grad_weight, grad_bias = batch_norm_backward(
        g, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
        tuple(output_mask[:3]), channel_axis=channel_axis)
    return grad_input, grad_weight, grad_bias, (g if output_mask[3] else None)
