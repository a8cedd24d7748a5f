"""kernels.transpose_last_two (the copy that lays grad_out out like input, or the reverse)
against NumPy: every kernel element type, shapes with and without 8 x 8 and tile edges,
serial and parallel."""

import numpy as np
import pytest

from bngrad import kernels


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int16, np.uint16, np.uint8])
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 8, 8), (3, 37, 45), (2, 64, 96), (1, 7, 70),
                                   (2, 33, 8), (1, 200, 3)])
@pytest.mark.parametrize("threads", [1, 2])
def test_transpose_last_two_is_numpys(dtype, shape, threads):
    rng = np.random.default_rng(sum(shape))
    source = rng.integers(0, 250, size=shape).astype(dtype)
    out = np.zeros((shape[0], shape[2], shape[1]), dtype)
    kernels.transpose_last_two(source, out, threads)
    np.testing.assert_array_equal(out, source.transpose(0, 2, 1))


def test_transpose_last_two_parallel_tiles():
    """Large enough that the parallel launcher runs it, with ragged tiles on both axes."""
    source = np.arange(3 * 1000 * 77, dtype=np.float32).reshape(3, 1000, 77)
    out = np.empty((3, 77, 1000), np.float32)
    kernels.transpose_last_two(source, out, 2)
    np.testing.assert_array_equal(out, source.transpose(0, 2, 1))
