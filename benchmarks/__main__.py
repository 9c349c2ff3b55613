"""``python -m benchmarks``: the kfac_ref benchmark suite (see :mod:`benchmarks.suite`).

    python -m benchmarks                       # both workloads, float32 and float64, NumPy
    python -m benchmarks --quick               # tiny sizes, one repeat: a smoke test
    python -m benchmarks --backend cupy        # on a GPU (the hand baseline runs on CuPy too)
    python -m benchmarks --workloads cnn-large # the CNN at N=512, twice the channels
    python -m benchmarks --out DIR             # where the JSON and Markdown go
                                               # (default ./benchmark-results/)
    python -m benchmarks --peers-only          # in a peer's environment: kfac_ref's full
                                               # update against curvlinops / kfac-jax
    python -m benchmarks --peers-only --backend torch
                                               # the same, kfac_ref on torch tensors

Exits 1 when a hand baseline disagrees with kfac_ref (the ratio would be meaningless).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

from kfac_ref.curvature import ESTIMATION_MODES

from . import suite

# glibc returns freed large blocks to the system (mmap'd allocations, heap trimming) until its
# dynamic thresholds have adapted, so the first rows of a run page-fault every fresh array
# (the first update row measured 1.38× where the same row run second gave 1.13×).  Fixed
# thresholds give every row the steady state a long training process reaches.
MALLOC_SETTINGS = {"MALLOC_MMAP_THRESHOLD_": str(2**32), "MALLOC_TRIM_THRESHOLD_": str(2**32)}


def _with_malloc_settings(argv):
    """Re-run this command with :data:`MALLOC_SETTINGS` (glibc reads them at start-up);
    ``KFAC_REF_BENCH_MALLOC=system`` keeps the system's defaults."""
    if (platform.system() != "Linux" or os.environ.get("KFAC_REF_BENCH_MALLOC") == "system"
            or all(os.environ.get(k) == v for k, v in MALLOC_SETTINGS.items())):
        return
    env = {**os.environ, **MALLOC_SETTINGS}
    args = [sys.executable, "-m", "benchmarks", *(sys.argv[1:] if argv is None else argv)]
    os.execve(sys.executable, args, env)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="kfac_ref against hand-written NumPy on an MLP and a CNN, same process, "
                    "interleaved; JSON and a Markdown table.")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and one repeat (a smoke test; figures mean nothing)")
    parser.add_argument("--backend", default="numpy", choices=("numpy", "strict", "torch", "cupy"))
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repeats per row (default 5, 1 with --quick)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"],
                        choices=("float32", "float64"))
    parser.add_argument("--workloads", nargs="+", default=["mlp", "cnn"],
                        choices=tuple(suite.WORKLOADS),
                        help="cnn-large: the CNN with N=512 and twice the channels (for GPUs)")
    parser.add_argument("--modes", nargs="+", default=list(ESTIMATION_MODES),
                        choices=ESTIMATION_MODES, help="estimation modes of the update rows")
    parser.add_argument("--no-memory", action="store_true", help="skip the conv memory rows")
    parser.add_argument("--no-peers", action="store_true",
                        help="skip the full-update rows against installed peers")
    parser.add_argument("--peers-only", action="store_true",
                        help="only the full-update rows against installed peers (run inside "
                             "a peer's environment)")
    parser.add_argument("--out", default="benchmark-results",
                        help="output folder (default ./benchmark-results/)")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1; got {args.repeats}")
    backend = suite.make_backend(args.backend)
    runner = suite.Runner(backend, quick=args.quick, repeats=args.repeats, modes=args.modes)
    makers = suite.WORKLOADS
    t0 = time.perf_counter()
    for name in args.workloads:
        wl = makers[name](args.quick)
        for dtype in args.dtypes:
            print(f"{wl.title}, {dtype}, backend {backend.name}", flush=True)
            if not args.peers_only:
                runner.run_workload(wl, dtype)
            if not args.no_peers and args.backend in ("numpy", "torch", "cupy"):
                runner.peer_rows(wl, dtype)
    if not (args.no_memory or args.peers_only):
        for dtype in args.dtypes:
            runner.conv_memory_rows(dtype)
            runner.chunking_rows(dtype)
    runner.missing_peer_rows()
    result = {"meta": {**suite.meta(args, backend),
                       "wall_s": time.perf_counter() - t0,
                       "malloc_env": {k: os.environ.get(k) for k in MALLOC_SETTINGS},
                       "workloads": {n: makers[n](args.quick).title for n in args.workloads}},
              "rows": runner.rows}
    failed = [r["row"] for r in runner.rows if "check" in r and not r["check"]["ok"]]
    result["meta"]["checks_passed"] = not failed
    jpath, mpath, text = suite.write(result, args.out)
    print()
    print(text)
    print(f"wrote {jpath} and {mpath}")
    if failed:
        print(f"benchmarks: the hand baseline disagrees with kfac_ref in {len(failed)} row(s): "
              f"{failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    _with_malloc_settings(None)
    sys.exit(main())
