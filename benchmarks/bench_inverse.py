"""One damped inverse of a K-FAC-sized factor: kfac_ref's Cholesky path against ``eigh``.

    python -m benchmarks.bench_inverse [--n 1001] [--repeats 5]

Times, interleaved in one process, ``kfac_ref.damped_matpower(M, -1, λ)`` (Cholesky and the
backend's triangular kernels, see the docs of :mod:`kfac_ref.linalg`), the eigendecomposition
path it replaces (``eigh``, then the eigenvalue power), and the array-API fallback (Cholesky,
then a general solve against ``I``, what backends without triangular kernels run), on
``M = XᵀX/256`` (rank 256, like the MLP's input factors) with ``λ = 1e-2``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import kfac_ref as K
from kfac_ref import linalg as L


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1001)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, args.n))
    xp = K._backend.namespace_of("bench", x=x)
    for dtype in (np.float32, np.float64):
        m = (x.T @ x / 256).astype(dtype)

        def eigh(m=m):
            s, q = L._clipped_eigh(xp, m, 0.0)
            return (q * L.power_of_eigenvalues(xp, s + 1e-2, -1.0)) @ q.T

        def fallback(m=m, dtype=dtype):
            low = L._damped_cholesky(xp, m, 1e-2)
            linv = xp.tril(xp.linalg.solve(low, np.eye(m.shape[0], dtype=dtype)))
            return linv.T @ linv

        fns = {"cholesky": lambda m=m: K.damped_matpower(m, -1, 1e-2), "eigh": eigh,
               "cholesky+solve(I)": fallback}
        ref = eigh()
        times = {k: [] for k in fns}
        for f in fns.values():
            f()
        for r in range(args.repeats):
            for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                t0 = time.perf_counter()
                out = fns[k]()
                times[k].append(time.perf_counter() - t0)
                err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
                assert err < 1e3 * np.finfo(dtype).eps * 100, (k, err)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        lo = {k: min(v) * 1e3 for k, v in times.items()}
        print(f"n={args.n} {np.dtype(dtype).name}: " + ", ".join(
            f"{k} {med[k]:.1f} ms (min {lo[k]:.1f})" for k in fns)
            + f"; eigh/cholesky {med['eigh'] / med['cholesky']:.1f}×")


if __name__ == "__main__":
    main()
