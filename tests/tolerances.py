"""Tolerances derived from the operation (team rule: no guessed atol), shared by the tests.

Two fp32 evaluations of the same math that differ only in summation order (another kernel,
another tiling or vector width, a cached prefix instead of a full pass, AVX2 against AVX-512)
agree to within the reordering bound of their longest reduction: a sum of n terms computed in
any order is within gamma_n ~ n * eps of the magnitude of its terms (Higham, Accuracy and
Stability of Numerical Algorithms, section 3.1).
"""

from __future__ import annotations

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)


def fp32_reorder_atol(reduction_len: int, reference) -> float:
    """The absolute tolerance for comparing against `reference` when only summation order may
    differ; `reduction_len` is the longest reduction on the path (the hidden size for logits),
    and `reference`'s largest magnitude stands for the magnitude of the summed terms."""
    return reduction_len * EPS32 * float(np.abs(np.asarray(reference, np.float64)).max())
