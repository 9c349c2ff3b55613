"""What the benchmark rows share: the loss, the damping, the problem data, the interleaved
timer and the agreement record (used by :mod:`benchmarks.suite` and :mod:`benchmarks.peers`).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from kfac_ref.losses import CategoricalLogitsNegativeLogProbLoss

DAMPING = 1e-2  # identity weight of the damped inverses and cached products


def on_gpu(backend_name):
    """Whether a run's kfac_ref arrays are on a GPU: CuPy arrays or torch CUDA tensors (the
    backend names of :func:`benchmarks.suite.make_backend`)."""
    return backend_name in ("cupy", "torch-cuda")


def ce(f, y):
    return CategoricalLogitsNegativeLogProbLoss(f, targets=y)


def host_problem(wl, dtype, seed):
    """The workload's batch ``(x, y)`` and parameters on the host, drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(wl.in_shape).astype(dtype)
    y = rng.integers(0, 10, size=wl.in_shape[0])
    params = tuple(tuple(np.asarray(a, dtype=dtype) for a in p)
                   for p in wl.net.init_params(rng, np.zeros(1)))
    return x, y, params


def _summary(times):
    t = sorted(times)
    q = statistics.quantiles(t, n=4) if len(t) >= 2 else [t[0], t[0], t[0]]
    return {"median_s": statistics.median(t), "q1_s": q[0], "q3_s": q[2], "min_s": t[0],
            "max_s": t[-1], "times_s": t}


def time_pair(kfac_fn, hand_fn, repeats, sync, warmup=True):
    """Time both contestants ``repeats`` times, interleaved, alternating who goes first.

    The warm-up runs both until a quarter of a second has passed (at least once, at most 50
    times): after a row of large arrays, the first few calls of a millisecond row pay for
    page faults and thread-pool wake-ups (3–4× their settled time here), which a single
    warm-up call does not absorb."""
    if warmup:
        start = time.perf_counter()
        for _ in range(50):
            kfac_fn()
            hand_fn()
            sync()
            if time.perf_counter() - start > 0.25:
                break
    out = {"kfac_ref": [], "hand": []}
    for r in range(repeats):
        pair = (("kfac_ref", kfac_fn), ("hand", hand_fn))
        for who, fn in (pair if r % 2 == 0 else pair[::-1]):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            out[who].append(time.perf_counter() - t0)
    return {k: _summary(v) for k, v in out.items()}


def rel_err(got, want):
    """Normwise relative error ``‖got − want‖_F / ‖want‖_F`` (host float64)."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    den = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / (den if den else 1.0))


def agreement(err, tol):
    """The agreement record of a row: its error, the tolerance and whether it holds."""
    return {"max_rel_err": err, "tol": tol, "ok": bool(err <= tol)}
