"""Norm-wise comparison of an implementation's output with the (converted) reference.

Rules that make a comparison trustworthy:

* the output must be convertible to a float64 array of exactly the expected shape;
* an empty expected or actual array never passes (there is nothing to compare);
* NaN or Inf anywhere in the output never passes;
* ``‖actual − expected‖_F ≤ rtol · max(‖expected‖_F, scale)`` with the case's tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Comparison", "compare", "as_float64"]


@dataclass(frozen=True)
class Comparison:
    ok: bool
    rel_err: float  # NaN when the comparison could not be made
    reason: str  # "" when ok; otherwise why it failed ("shape", "non-finite", ...)
    detail: str = ""


def as_float64(x):
    """Read an adapter's output as a float64 ndarray (``None`` on failure)."""
    if x is None:
        return None
    try:
        if hasattr(x, "detach"):  # torch tensors that require grad
            x = x.detach()
        if hasattr(x, "cpu") and not isinstance(x, np.ndarray):
            x = x.cpu()
        arr = np.asarray(x)
        if arr.dtype.kind not in "fiub":
            return None
        return arr.astype(np.float64)
    except Exception:  # noqa: BLE001 - any conversion failure is reported as "not an array"
        return None


def compare(actual, expected, rtol, scale=0.0) -> Comparison:
    expected = np.asarray(expected, dtype=np.float64)
    act = as_float64(actual)
    if act is None:
        return Comparison(False, float("nan"), "not-an-array",
                          f"output of type {type(actual).__name__} is not a real array")
    if expected.size == 0:
        return Comparison(False, float("nan"), "empty", "the expected output is empty: an empty "
                                                        "comparison never passes")
    if act.shape != expected.shape:
        return Comparison(False, float("nan"), "shape",
                          f"shape {act.shape} != expected {expected.shape}")
    if not np.all(np.isfinite(act)):
        bad = int(np.sum(~np.isfinite(act)))
        return Comparison(False, float("nan"), "non-finite",
                          f"{bad} of {act.size} output entries are NaN/Inf")
    if not np.all(np.isfinite(expected)):
        return Comparison(False, float("nan"), "reference-non-finite",
                          "the reference itself is not finite (a catalogue bug)")
    denom = max(float(np.linalg.norm(expected)), float(scale), np.finfo(np.float64).tiny)
    rel = float(np.linalg.norm(act - expected)) / denom
    if rel <= rtol:
        return Comparison(True, rel, "")
    return Comparison(False, rel, "value", f"relative error {rel:.3e} > rtol {rtol:.3e}")
