"""The tolerance helper itself (tests/tolerances.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tolerances import assert_close


def test_the_nearest_subnormal_half_passes_and_one_unit_off_fails():
    """Found by hypothesis (test_properties.test_backward_property, 2026-12-04): an eval-mode
    float16 backward whose float16 grad_weight is subnormal, the reference -4.15169284e-06
    (float16 spacing there 6.0e-8, 1.4% of it): bngrad returned the nearest float16,
    -4.17232513e-06, which the bound (0.4% of the value) refused. The nearest value passes;
    the next one towards zero still fails."""
    expected = np.array([-4.15169284e-06])
    nearest = expected.astype(np.float16)
    assert float(nearest[0]) == pytest.approx(-4.17232513e-06, rel=1e-8)
    assert_close(nearest, expected, what="grad_weight")
    with pytest.raises(AssertionError, match="out of tolerance"):
        assert_close(np.nextafter(nearest, np.float16(0)), expected)


def test_normal_results_keep_their_bound():
    """Where the dtype's spacing is finer than rtol, the allowance for rounding changes
    nothing: a float16 result 0.3% off (rtol 0.2%) fails."""
    with pytest.raises(AssertionError, match="out of tolerance"):
        assert_close(np.array([1.0, 1.0029], np.float16), np.array([1.0, 1.0]), scale=0.0)
