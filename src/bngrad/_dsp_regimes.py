"""Value regimes that break naive BatchNormGrad kernels: extra distributions for bngrad.vectors.

Each draws x, dy and scale in float64 for the data dtype asked; mean and invar then come from
the stored x exactly as for ``normal`` data (batch statistics in train mode, nearby running
statistics in eval mode, ``invar = 1/sqrt(var + 1e-5)``), and the expected outputs from the
float64 reference. What each one is for:

``offset``
    |mean| much larger than the standard deviation (ratio 2**7..2**9 for float16 data,
    2**14..2**16 for float32): a kernel that expands ``sum(dy*(x - mean))`` into
    ``sum(dy*x) - mean*sum(dy)`` loses most of its bits to cancellation.
``huge``
    x within a factor of two of the data dtype's largest value (65504 for float16), dy as
    large as the sums allow (``|dy| <= max/(4*batch)``, ``max/1024`` for batch 1): ``sum(x)``,
    ``x*x`` or ``dy*x`` in the data dtype overflow. Every expected output stays finite.
``subnormal``
    Every dy subnormal in the data dtype (below 2**-14 for float16, 2**-126 for float32): a
    device that flushes subnormals to zero returns zero dx and dbias.
``zerovar``
    Every fourth channel (0, 4, 8, ...) constant, so its variance is exactly 0, ``x - mean``
    exactly 0 and ``invar = 1/sqrt(1e-5)``; the other channels as ``normal``.
"""

from __future__ import annotations

import numpy as np

#: name -> one line for help texts
REGIMES = {
    "offset": "|mean| >> std (cancellation in sum(dy*x) - mean*sum(dy))",
    "huge": "x near the data dtype's largest value, dy as large as the sums allow",
    "subnormal": "every dy subnormal in the data dtype (flush-to-zero shows)",
    "zerovar": "every fourth channel constant: variance exactly 0",
}

#: |mean| / std, roughly, per data dtype (float16 has 11 significant bits, float32 24)
_OFFSET = {np.dtype(np.float16): 2.0 ** 8, np.dtype(np.float32): 2.0 ** 15}


def draw(rng: np.random.Generator, batch: int, channel: int, regime: str,
         dtype: np.dtype) -> dict[str, np.ndarray]:
    """x, dy (batch, channel) and scale (channel,) in float64 for ``regime`` (see the module
    docstring), sized for the data dtype ``dtype`` (float16 or float32)."""
    dtype = np.dtype(dtype)
    shape = (batch, channel)
    sign = rng.choice([-1.0, 1.0], channel)
    scale = rng.uniform(0.5, 1.5, channel) * rng.choice([-1.0, 1.0], channel)
    dy = rng.standard_normal(shape)
    if regime == "offset":
        sigma = rng.uniform(0.5, 2.0, channel)
        mu = sign * sigma * _OFFSET[dtype] * rng.uniform(0.5, 2.0, channel)
        x = mu + sigma * rng.standard_normal(shape)
    elif regime == "huge":
        top = float(np.finfo(dtype).max)
        # |x| <= (0.75 + 0.2) * max: large enough that sum(x) and x*x overflow, never inf
        mu = sign * top * rng.uniform(0.5, 0.75, channel)
        x = mu + top * rng.uniform(0.05, 0.2, channel) * rng.uniform(-1.0, 1.0, shape)
        # sum(|dy|) <= max/4 keeps dbias finite, and sum(|dy*xhat|) (|xhat| summing to about
        # batch) keeps dscale finite too. One row has variance 0, so invar = 1/sqrt(1e-5) and
        # eval's dx = dy*invar*scale needs dy 1024 times smaller.
        limit = top / (4 * batch) if batch > 1 else top / 1024
        dy = rng.uniform(-1.0, 1.0, shape) * limit
    elif regime == "subnormal":
        x = rng.uniform(-1.0, 1.0, channel) + rng.uniform(0.5, 2.0, channel) \
            * rng.standard_normal(shape)
        dy = rng.uniform(-0.9, 0.9, shape) * float(np.finfo(dtype).smallest_normal)
    elif regime == "zerovar":
        sigma = rng.uniform(0.5, 2.0, channel)
        sigma[::4] = 0.0
        x = rng.uniform(-1.0, 1.0, channel) + sigma * rng.standard_normal(shape)
    else:
        raise ValueError(f"regime: expected one of {', '.join(REGIMES)}, got {regime!r}")
    return {"x": x, "dy": dy, "scale": scale}
