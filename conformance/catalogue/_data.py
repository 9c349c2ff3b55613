"""Host-side (NumPy) data builders shared by the catalogue modules."""

from __future__ import annotations

import numpy as np


def spd(rng, n, low=0.5, high=4.0, scale=1.0):
    """Symmetric positive definite n×n matrix with eigenvalues in scale·[low, high]."""
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    s = rng.uniform(low, high, size=n) * scale
    m = (q * s) @ q.T
    return (m + m.T) / 2


def psd(rng, n, rank, scale=1.0):
    """Symmetric PSD n×n matrix of the given rank."""
    x = rng.standard_normal((rank, n))
    m = scale * (x.T @ x) / max(rank, 1)
    return (m + m.T) / 2


def cond(m):
    """2-norm condition number of a symmetric matrix (∞ for a singular one)."""
    s = np.abs(np.linalg.eigvalsh((m + m.T) / 2))
    return float(s.max() / s.min()) if s.min() > 0 else float("inf")


def block_diag(mats):
    """The block-diagonal matrix of square NumPy blocks ``mats``, in order."""
    n = sum(m.shape[0] for m in mats)
    out, o = np.zeros((n, n)), 0
    for m in mats:
        out[o:o + m.shape[0], o:o + m.shape[0]] = m
        o += m.shape[0]
    return out


def to_np(x):
    """A kfac_ref result (NumPy backend) or a Python float as a float64 ndarray."""
    return np.asarray(x, dtype=np.float64)
