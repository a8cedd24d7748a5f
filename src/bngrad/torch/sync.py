"""Synchronized batch norm on the CPU, over torch.distributed (gloo or any other backend).

``torch.nn.SyncBatchNorm`` refuses CPU tensors; this one computes on bngrad's kernels and
talks to the other ranks through ``torch.distributed``. Per layer and training step:

forward
    local per-channel count, mean and M2 (``bngrad.batch_norm_moments``) -> one all_gather of
    ``[count, mean(C), M2(C)]`` (2C+1 float64 per rank) -> every rank combines the W partial
    moments the same way, in float64, by count (exact for uneven batches; an empty rank sends
    count 0) -> local normalisation with the global mean and variance.
backward
    local ``batch_norm_backward_reduce`` -> one all_reduce of the stacked (2, C) float64
    ``[sum_dy, sum_dy_xmu]`` -> local ``batch_norm_backward_elemt`` with the global count.
    grad_weight / grad_bias stay local, as in PyTorch: DistributedDataParallel averages them.

The first training forward of each layer in a process group also all-gathers the channel
count, once, so that ranks whose layers disagree get a clear error instead of a collective of
mismatched sizes (which gloo answers with corrupted data or an abort). After that the layer
checks ``input.size(1) == num_features`` locally before every collective.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

import bngrad as _api  # the public core API
from .. import _dtypes
from .. import _gomp
from ..errors import ArgumentValueError, BngradError
from ..kernels import inv_std
from ._convert import from_numpy, output_like, param_dtype_error, to_numpy, to_numpy_optional
from .functional import batch_norm  # the plain, local layer
from .functional import needs_pytorch_autodiff
from .fused import _FusedBatchNorm
from .modules import _BngradModule, _replace, _share_state

__all__ = ["SyncBatchNorm", "CollectiveError", "combine_moments"]


class CollectiveError(BngradError, RuntimeError):
    """A collective of SyncBatchNorm failed: a peer rank died, or did not reach it in time."""


def _collective(op: str, layer: str, group: Any, call: Any) -> None:
    """Run one collective, turning the backend's error into one that says what to look for."""
    try:
        call()
    except RuntimeError as exc:  # gloo/nccl/mpi errors, timeouts included (DistBackendError)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        raise CollectiveError(
            f"SyncBatchNorm ({layer}) on rank {rank} of {world}: the {op} failed. Another rank "
            "died, or did not reach the same SyncBatchNorm step within the process group's "
            "timeout (init_process_group(timeout=...)); every rank must run the same layers in "
            f"the same order. Look at the other ranks' logs. Backend error: {exc}") from exc


def _all_gather(buf: torch.Tensor, layer: str, group: Any, world: int) -> torch.Tensor:
    """(world, *buf.shape) tensor of every rank's ``buf``, in rank order."""
    parts = [torch.empty_like(buf) for _ in range(world)]
    _collective("all_gather of batch statistics", layer, group,
                lambda: dist.all_gather(parts, buf, group=group))
    return torch.stack(parts)


def _check_same_channels(n_channels: int, layer: str, group: Any, world: int) -> None:
    """Raise the same clear error on every rank when ranks disagree about C."""
    gathered = _all_gather(torch.tensor([n_channels], dtype=torch.int64), layer, group, world)
    counts = gathered.view(-1).tolist()
    if len(set(counts)) != 1:
        raise ArgumentValueError(
            f"SyncBatchNorm ({layer}): the ranks disagree about the number of channels: "
            f"rank -> C is {dict(enumerate(counts))}. Every rank must build the same model and "
            "feed it inputs with the same channel count.")


def combine_moments(counts: np.ndarray, means: np.ndarray, m2s: np.ndarray
                    ) -> tuple[float, np.ndarray, np.ndarray]:
    """Global (count, mean, biased var) from per-rank (count, mean, M2), in float64.

    Chan et al.'s parallel combination, for W parts at once: the global mean weights each
    part's mean by its count, and M2 = sum M2_r + sum n_r (mean_r - mean)^2 adds the spread of
    the part means around it — no E[x^2] - E[x]^2 cancellation. Parts with count 0 drop out.
    Every rank runs this on the same gathered numbers, so every rank gets identical results.

    Parameters
    ----------
    counts : (W,) elements per channel on each rank
    means, m2s : (W, C) per-rank mean and sum of squared deviations from it

    Returns
    -------
    total : float, mean : (C,), var : (C,)  (zeros when ``total`` is 0)
    """
    counts = np.asarray(counts, dtype=np.float64)
    total = float(counts.sum())
    if total == 0:
        return 0.0, np.zeros(means.shape[1]), np.zeros(means.shape[1])
    w = counts[:, None]
    mean = (w * means).sum(axis=0) / total
    m2 = m2s.sum(axis=0) + (w * (means - mean) ** 2).sum(axis=0)
    return total, mean, m2 / total


class _SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm with statistics over every rank of ``group``."""

    @staticmethod
    @_gomp.on_torch_team
    def forward(ctx: Any, input: torch.Tensor, weight: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], running_mean: Optional[torch.Tensor],
                running_var: Optional[torch.Tensor], eps: float, momentum: float,
                group: Any, world: int, layer: str) -> torch.Tensor:
        x = to_numpy(input, "input")
        n_channels = x.shape[1]
        local_count = x.size // n_channels if n_channels else 0
        if local_count:
            mean, var = _api.batch_norm_moments(x, channel_axis=1,
                                                num_threads=torch.get_num_threads())
        else:
            mean = var = np.zeros(n_channels)
        buf = torch.from_numpy(np.concatenate([[local_count], mean, var * local_count]))
        stats = _all_gather(buf, layer, group, world).numpy()
        total, gmean, gvar = combine_moments(stats[:, 0], stats[:, 1:n_channels + 1],
                                             stats[:, n_channels + 1:])
        if total == 1:  # the same on every rank: they all raise, none waits on the others
            raise ArgumentValueError(
                f"SyncBatchNorm ({layer}): expected more than 1 value per channel when "
                f"training, got 1 over all {world} ranks (input shape here {tuple(input.shape)})")
        # The global statistics, combined in float64, go to the core API at the widest dtype it
        # accepts for this input's per-channel vectors: float64 for float64 and half inputs,
        # float32 for float32. Not the forward's save_mean dtype (_dtypes.stat_dtype, float32
        # for halves, PyTorch's): these are never returned, they only normalise here and are
        # saved for the backward, so a half input keeps the bits float64 holds over float32.
        stat_dtype = max(_dtypes.spec(x.dtype).param_dtypes, key=lambda d: d.itemsize)
        mean_s = gmean.astype(stat_dtype)
        invstd_s = inv_std(gvar, eps, train=True).astype(stat_dtype)

        if total > 0:  # an all-empty global batch leaves running stats alone, as torch does
            with torch.no_grad():
                if running_mean is not None:
                    running_mean.copy_(torch.from_numpy(
                        (1 - momentum) * running_mean.double().numpy() + momentum * gmean))
                if running_var is not None:
                    unbiased = gvar * (total / (total - 1))
                    running_var.copy_(torch.from_numpy(
                        (1 - momentum) * running_var.double().numpy() + momentum * unbiased))

        output = output_like(input)  # PyTorch's memory format, as the plain layers'
        if local_count:
            # Eval-mode batch norm with the global statistics is exactly the normalisation step.
            _api.batch_norm_forward(
                x, to_numpy_optional(weight, "weight"), to_numpy_optional(bias, "bias"),
                mean_s, gvar.astype(stat_dtype), train=False, eps=eps, channel_axis=1,
                num_threads=torch.get_num_threads(), out=to_numpy(output))

        ctx.save_for_backward(input, weight, torch.from_numpy(mean_s), torch.from_numpy(invstd_s))
        ctx.total, ctx.group, ctx.layer = total, group, layer
        ctx.bias_dtype = None if bias is None else bias.dtype
        return output

    @staticmethod
    @once_differentiable
    @_gomp.on_torch_team
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        input, weight, mean, invstd = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        need_weight = need_weight and weight is not None
        need_bias = need_bias and ctx.bias_dtype is not None
        n_channels = input.shape[1]
        x, dy = to_numpy(input, "input"), to_numpy(grad_output, "grad_output")
        w, mean_np, invstd_np = to_numpy_optional(weight, "weight"), mean.numpy(), invstd.numpy()

        grad_input = grad_weight = grad_bias = None
        if input.numel():
            sum_dy, sum_dy_xmu, gw, gb = _api.batch_norm_backward_reduce(
                dy, x, mean_np, invstd_np, w, need_input, need_weight, need_bias,
                channel_axis=1, num_threads=torch.get_num_threads())
            if need_weight:
                grad_weight = from_numpy(np.asarray(gw)).to(weight.dtype)
            if need_bias:
                grad_bias = from_numpy(np.asarray(gb)).to(ctx.bias_dtype)
        else:
            sum_dy = sum_dy_xmu = np.zeros(n_channels)
            # Explicit zeros rather than None: DDP then sees a gradient for every parameter.
            if need_weight:
                grad_weight = torch.zeros_like(weight)
            if need_bias:
                grad_bias = torch.zeros(n_channels, dtype=ctx.bias_dtype)

        if need_input:  # same decision on every rank (same model), so all join the all_reduce
            sums = torch.from_numpy(np.stack([np.asarray(sum_dy, dtype=np.float64),
                                              np.asarray(sum_dy_xmu, dtype=np.float64)]))
            _collective("all_reduce of gradient sums", ctx.layer, ctx.group,
                        lambda: dist.all_reduce(sums, dist.ReduceOp.SUM, group=ctx.group))
            if input.numel():
                s = sums.numpy().astype(mean_np.dtype)
                grad_input = from_numpy(_api.batch_norm_backward_elemt(
                    dy, x, mean_np, invstd_np, w, s[0], s[1], int(ctx.total), channel_axis=1,
                    num_threads=torch.get_num_threads()))
            else:
                grad_input = torch.zeros_like(input)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None


class SyncBatchNorm(_BngradModule, _BatchNorm):
    r"""Batch norm over the whole global batch of a torch.distributed process group, on the CPU.

    The constructor, the state_dict (``weight``, ``bias``, ``running_mean``, ``running_var``,
    ``num_batches_tracked``) and the behaviour are those of ``torch.nn.SyncBatchNorm``; only the
    device differs: CPU tensors (float64, float32, float16, bfloat16, any memory format), any
    ``torch.distributed`` backend (gloo for CPU-only machines).

    In training mode, with ``torch.distributed`` initialised and more than one rank in the
    group, the mean and variance are those of the concatenation of every rank's batch (uneven
    and empty local batches included), the running statistics are updated identically on every
    rank, and grad_input is that of batch norm over the global batch. Otherwise (eval mode with
    running statistics, a group of one, no process group) it is the plain, local batch norm
    and communicates nothing.

    Parameters
    ----------
    num_features : int
        C, from inputs of shape (N, C, ...).
    eps : float
        Added to the variance for numerical stability.
    momentum : float or None
        Running statistics factor; None for a cumulative average.
    affine : bool
        Learnable per-channel weight and bias.
    track_running_stats : bool
        Keep running mean and variance (used in eval mode).
    process_group : ProcessGroup, optional
        The ranks to synchronise with; default the whole world.
    device, dtype
        Of the parameters and buffers (CPU).
    bias : bool
        With ``affine``, whether there is a learnable bias (keyword only, as PyTorch's).

    Examples
    --------
    >>> model = SyncBatchNorm.convert_sync_batchnorm(model)       # doctest: +SKIP
    >>> model = torch.nn.parallel.DistributedDataParallel(model)  # doctest: +SKIP
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: Any = None, device: Any = None, dtype: Any = None, *,
                 bias: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype, bias=bias)
        self.process_group = process_group
        self._checked_group: Optional[int] = None  # id() of the group C was verified in

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ArgumentValueError(
                f"SyncBatchNorm: expected input with at least 2 dimensions (N, C, ...), "
                f"got {input.dim()}-D input of shape {tuple(input.shape)}")
        if input.size(1) != self.num_features:
            raise ArgumentValueError(
                f"SyncBatchNorm: expected input with {self.num_features} channels in dimension "
                f"1 (num_features), got shape {tuple(input.shape)}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Batch norm of ``input``, with statistics of the whole group's batch in training."""
        self._check_input_dim(input)
        group, world = None, 1
        if self.training and dist.is_available() and dist.is_initialized():
            group = self.process_group or dist.group.WORLD
            world = dist.get_world_size(group)
        layer = f"{type(self).__name__}({self.num_features})"
        if world > 1:
            # (before the batch is counted and before any collective; the one-process path's
            # error says the same, from the core's refusal)
            error = param_dtype_error(input, {"weight": self.weight, "bias": self.bias,
                                              "running_mean": self.running_mean,
                                              "running_var": self.running_var})
            if error is not None:
                raise error
        if world > 1 and needs_pytorch_autodiff(input, self.weight, self.bias):
            # (before the batch is counted and before any collective)
            raise NotImplementedError(
                f"SyncBatchNorm ({layer}): forward-mode AD and torch.func's differentiating "
                f"transforms (grad, jacrev, jvp, ...) are not supported across processes "
                f"({world} ranks here): the statistics of the whole group have no forward "
                "derivative; use torch.autograd (reverse mode), or a batch norm per process "
                "(bngrad.torch.BatchNorm2d, ...) under these transforms")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        # Batch statistics in training, and in eval mode when there are no running stats.
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        running_mean = self.running_mean if track else None
        running_var = self.running_var if track else None
        if world <= 1:
            return batch_norm(input, running_mean, running_var, self.weight, self.bias,
                              bn_training, factor, self.eps)
        if self._checked_group != id(group):
            _check_same_channels(input.size(1), layer, group, world)
            self._checked_group = id(group)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean,
                                            running_var, self.eps, factor, group, world, layer)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, process_group: Any = None
                               ) -> torch.nn.Module:
        """Replace every BatchNorm*d (PyTorch's or bngrad's) in ``module`` by SyncBatchNorm.

        Parameters, buffers (running statistics, ``num_batches_tracked``) and the training flag
        are shared with / copied from the layers replaced, as ``torch.nn.SyncBatchNorm``'s does;
        a layer reachable by two names becomes one SyncBatchNorm. Returns the new layer when
        ``module`` itself is a batch-norm layer, else ``module``.

        Raises
        ------
        ArgumentValueError
            ``module`` holds fused batch norm modules (``BatchNormReLU2d``,
            ``BatchNormAddReLU2d``, ...): SyncBatchNorm has no fused form, and replacing them
            would drop their ReLU and add. (PyTorch's own
            ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` replaces them without a word.) A
            model fused by ``convert(model, fuse=True)`` has none: its batch norms convert,
            and its fused calls run them unfused.
            ``module`` holds a lazy batch norm (``LazyBatchNorm2d``, ...) not yet initialised:
            its number of features is unknown (PyTorch's converter makes it a
            ``SyncBatchNorm(0)``, which refuses every input); run one batch first.
        """
        fused = [name or "<model>" for name, m in module.named_modules()
                 if isinstance(m, _FusedBatchNorm)]
        if fused:
            raise ArgumentValueError(
                f"bngrad.torch.SyncBatchNorm.convert_sync_batchnorm: {', '.join(fused)} "
                f"{'is a fused batch norm' if len(fused) == 1 else 'are fused batch norms'} "
                "(batch norm + ReLU), which SyncBatchNorm cannot replace without dropping the "
                "ReLU; use bngrad.torch.BatchNorm2d (1d, 3d) and the ReLU there, or "
                "bngrad.torch.convert(model, fuse=True), whose fused calls keep the batch norm "
                "modules (not revert(model): it leaves fused modules built by hand)")
        lazy = [name or "<model>" for name, m in module.named_modules()
                if isinstance(m, _BatchNorm) and isinstance(m, LazyModuleMixin)
                and m.has_uninitialized_params()]
        if lazy:  # (PyTorch's converter makes them SyncBatchNorm(0), which no input fits)
            raise ArgumentValueError(
                f"bngrad.torch.SyncBatchNorm.convert_sync_batchnorm: {', '.join(lazy)} "
                f"{'is a lazy batch norm' if len(lazy) == 1 else 'are lazy batch norms'} "
                "whose number of features is not known yet; run the model on one batch "
                "first (which initialises them), then convert it")

        def new_for(bn: torch.nn.Module) -> Optional[torch.nn.Module]:
            if not isinstance(bn, _BatchNorm):
                return None
            return _share_state(cls(bn.num_features, bn.eps, bn.momentum, bn.affine,
                                    bn.track_running_stats, process_group), bn)
        return _replace(module, new_for)
