"""Benchmark: matrix-free Kronecker products against the dense product, in one run.

Reports, for factor sizes p = q, the time of

* ``kron_matvec(A, B, x)`` (two GEMMs, O(p²q + pq²)) and
* ``kron_damped_inverse_matvec`` with factored and exact damping,

as ratios against dense baselines measured in the same process: ``np.kron(A, B) @ x`` for the
product and ``np.linalg.solve(np.kron(A, B) + λI, x)`` (O(p³q³)) for the inverses.  Usage::

    python benchmarks/bench_kron.py [--sizes 16 32 64] [--backend numpy|strict|torch|cupy]

Ratios < 1 mean kfac_ref is faster than the dense baseline.  Nothing here is asserted; tests
never time things.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import numpy as np

import kfac_ref as K


def _timeit(fn, repeat=7, sync=lambda: None):
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _backend(name):
    if name == "numpy":
        import array_api_compat.numpy as xp

        return (lambda a: xp.asarray(a)), (lambda: None)
    if name == "strict":
        import array_api_strict as xs

        return (lambda a: xs.asarray(a)), (lambda: None)
    if name == "torch":
        import torch

        return (lambda a: torch.asarray(a)), (lambda: None)
    if name == "cupy":
        import cupy

        return (lambda a: cupy.asarray(a)), cupy.cuda.Device().synchronize
    raise SystemExit(f"unknown backend {name!r}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--backend", default="numpy")
    args = parser.parse_args(argv)
    to_backend, sync = _backend(args.backend)
    rng = np.random.default_rng(0)
    print(f"backend={args.backend}  baselines: dense NumPy float64 kron @ x and dense solve")
    print(f"{'p=q':>5} {'kron@x [ms]':>12} {'matvec':>8} {'solve [ms]':>11} {'inv fact.':>10} "
          f"{'inv exact':>10}")
    for n in args.sizes:
        a = rng.standard_normal((n, n))
        a = a @ a.T / n
        b = rng.standard_normal((n, n))
        b = b @ b.T / n
        x = rng.standard_normal(n * n)
        base = _timeit(lambda a=a, b=b, x=x: np.kron(a, b) @ x)
        eye = np.eye(n * n)
        solve = _timeit(lambda a=a, b=b, x=x, eye=eye: np.linalg.solve(np.kron(a, b) + 0.1 * eye,
                                                                        x), repeat=3)
        ab, bb, xb = to_backend(a), to_backend(b), to_backend(x)
        mv = _timeit(partial(K.kron_matvec, ab, bb, xb), sync=sync)
        fact = _timeit(partial(K.kron_damped_inverse_matvec, ab, bb, xb, 0.1, "factored"),
                       sync=sync)
        exact = _timeit(partial(K.kron_damped_inverse_matvec, ab, bb, xb, 0.1, "exact"),
                        sync=sync)
        print(f"{n:>5} {base * 1e3:>12.3f} {mv / base:>8.4f} {solve * 1e3:>11.2f} "
              f"{fact / solve:>10.4f} {exact / solve:>10.4f}")


if __name__ == "__main__":
    main()
