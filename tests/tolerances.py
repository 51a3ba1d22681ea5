"""Tolerances of float32 results that two different programs compute (another fusion, another order of a sum, another
CPU's vector width: AVX2 and AVX-512 round differently): units of float32's epsilon scaled by the values' magnitude,
never a fixed absolute tolerance that holds on one instruction set and fails on another. Results of the same
program compare exactly (np.testing.assert_array_equal)."""

import numpy as np

FLOAT32_EPS = float(np.finfo(np.float32).eps)


def assert_float32_close(got, want, ulps: float = 64):
    """`got` equals `want` to within `ulps` float32 epsilons of `want`'s largest magnitude (a sum's rounding error
    scales with its terms' magnitude, not each element's; 64 leaves room for a layer's depth of sums)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    atol = ulps * FLOAT32_EPS * float(np.abs(want).max(initial=0.0))
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)
