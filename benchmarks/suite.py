"""The benchmark suite: kfac_ref against hand-written NumPy, same process, interleaved.

Rows (per workload and dtype):

* ``update``: :meth:`BlockDiagonalCurvature.update_curvature_matrix_estimate` from ``(X, y)``
  (forward and backward passes included), one row per estimation mode;
* ``inverses``: :meth:`BlockDiagonalCurvature.update_cache` with the approximate power −1
  (π-damped factor inverses);
* ``cached_product``: :meth:`BlockDiagonalCurvature.multiply_matpower` with the cached power −1;
* ``conv_memory`` (NumPy only): peak traced memory of the KFC input factor of the CNN's second
  convolution at two batch sizes;
* ``chunking``: the cost of the memory bound — the KFC input factor and ``nn.Conv2D``'s backward
  pass (input cotangent and weight gradient) of that convolution at N = 128 with an 8 MiB
  ``max_temporary_bytes`` (several chunks) against the same kfac_ref call in one shot; here the
  "hand" column is kfac_ref unchunked (the targets, as for every row, are
  :data:`benchmarks.plot.TARGETS`).

Before a row is timed, its hand baseline is run on the same inputs as kfac_ref (the same
output vectors for the stochastic modes) and their results must agree to rounding; a row whose
check fails is reported as failed and the run exits non-zero.  Ratios are
``median(kfac_ref) / median(hand)``: below 1 kfac_ref is faster.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
import tracemalloc
from dataclasses import dataclass, field

import numpy as np

import kfac_ref
import kfac_ref.nn as nn
from kfac_ref.curvature import ESTIMATION_MODES, BlockDiagonalCurvature, estimation_output_vectors
from kfac_ref.factors import conv_input_kronecker_factor

from . import hand, peers
from .common import DAMPING, ce, host_problem, rel_err, time_pair
from .common import agreement as _check

SCHEMA_VERSION = 2


# --------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------
@dataclass
class Backend:
    """How to move host arrays to a backend, synchronise it, and which module the hand
    baseline uses (NumPy, or CuPy on a GPU)."""

    name: str
    to: object
    to_host: object
    sync: object = field(default=lambda: None)
    hand: object = np
    hand_to: object = field(default=lambda a: a)


def make_backend(name):
    if name == "numpy":
        return Backend("numpy", lambda a: a, np.asarray)
    if name == "strict":
        import array_api_strict as xs

        return Backend("strict", xs.asarray, lambda a: np.asarray(a))
    if name == "torch":
        import torch

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        to = lambda a: torch.asarray(a, device=dev)  # noqa: E731
        to_host = lambda a: a.detach().cpu().numpy()  # noqa: E731
        if dev == "cpu":
            return Backend("torch-cpu", to, to_host)
        try:  # the hand baseline on the same GPU, through CuPy, when it is installed
            import cupy
        except ImportError:
            cupy = None
        if cupy is None:
            return Backend("torch-cuda", to, to_host, torch.cuda.synchronize)

        def sync():  # torch's and CuPy's streams: wait for the whole device
            torch.cuda.synchronize()
            cupy.cuda.Device().synchronize()

        return Backend("torch-cuda", to, to_host, sync, cupy, cupy.asarray)
    if name == "cupy":
        import cupy

        sync = cupy.cuda.Device().synchronize
        return Backend("cupy", cupy.asarray, cupy.asnumpy, sync, cupy, cupy.asarray)
    raise SystemExit(f"benchmarks: --backend must be numpy, strict, torch or cupy; got {name!r}.")


# --------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------
@dataclass
class Workload:
    name: str
    title: str
    net: object
    in_shape: tuple
    hand_update: object
    scales: tuple  # the blocks' fixed scales (|T| for convolutions)
    spec: list  # the same network as a portable spec (conformance.peers.nets), for the peers


def mlp_workload(quick):
    d_in, width, n = (16, 8, 8) if quick else (784, 1000, 256)
    net = nn.Sequential([("d1", nn.Dense(d_in, width)), ("a1", nn.Activation("tanh")),
                         ("d2", nn.Dense(width, width)), ("a2", nn.Activation("tanh")),
                         ("d3", nn.Dense(width, 10))])
    spec = [_dense(d_in, width), _act("tanh"), _dense(width, width), _act("tanh"),
            _dense(width, 10)]
    return Workload("mlp", f"MLP {d_in}→{width}→{width}→10 tanh, N={n}", net, (n, d_in),
                    hand.mlp_update, (1.0, 1.0, 1.0), spec)


def cnn_workload(quick):
    return _cnn("cnn", *((8, 4, 8, 4) if quick else (32, 32, 64, 128)))


def cnn_large_workload(quick):
    """The CNN with twice the channels and four times the batch (N = 512): on a GPU, out of
    the regime where fixed per-call costs dominate."""
    return _cnn("cnn-large", *((8, 4, 8, 8) if quick else (32, 64, 128, 512)))


def _cnn(name, size, c1, c2, n):
    net = nn.Sequential([("c1", nn.Conv2D(3, c1, 3, padding="SAME")),
                         ("r1", nn.Activation("relu")),
                         ("c2", nn.Conv2D(c1, c2, 3, stride=2, padding="SAME")),
                         ("r2", nn.Activation("relu")), ("pool", nn.MeanPool()),
                         ("d", nn.Dense(c2, 10))])
    half = -(-size // 2)
    return Workload(name, f"CNN {size}×{size}×3, conv 3→{c1}, conv {c1}→{c2}/2, pool, "
                    f"dense {c2}→10, N={n}", net, (n, size, size, 3), hand.cnn_update,
                    (float(size * size), float(half * half), 1.0),
                    [_conv(3, c1, 1), _act("relu"), _conv(c1, c2, 2), _act("relu"),
                     {"kind": "mean_pool"}, _dense(c2, 10)])


def short_repeats(repeats):
    """Timed repeats of the millisecond rows (inverses, cached products): with 5 samples
    they move ±10 % between runs of the same code, so four times as many, at least 20."""
    return max(repeats, 5) * 4


#: the workloads by name (``--workloads``); the first two run by default
WORKLOADS = {"mlp": mlp_workload, "cnn": cnn_workload, "cnn-large": cnn_large_workload}


def _dense(d_in, d_out):
    return {"kind": "dense", "d_in": d_in, "d_out": d_out, "bias": True}


def _conv(c_in, c_out, stride):
    return {"kind": "conv2d", "c_in": c_in, "c_out": c_out, "kernel": (3, 3), "stride": stride,
            "dilation": 1, "padding": "SAME", "bias": True}


def _act(fn):
    return {"kind": "activation", "fn": fn}


# --------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------
class Runner:
    def __init__(self, backend, quick=False, repeats=5, modes=ESTIMATION_MODES, seed=0,
                 log=print):
        self.b = backend
        self.quick = quick
        self.repeats = repeats
        self.short_repeats = short_repeats(repeats)
        self.modes = tuple(modes)
        self.seed = seed
        self.log = log
        self.rows = []

    # tolerance of the agreement checks: a backward pass and a GEMM over `terms` products
    # accumulate at most ~sqrt(terms) roundings in the normwise sense; 64·sqrt(terms)·eps
    # leaves room for the symmetrisation and the loss derivatives and is still ≥ 1e3 times
    # below what a wrong baseline (a missing factor, a wrong layer) gives.
    @staticmethod
    def tol(dtype, terms=1, cond=1.0):
        return 64.0 * math.sqrt(terms) * cond * float(np.finfo(dtype).eps)

    def _add(self, row):
        self.rows.append(row)
        k, h = row.get("kfac_ref"), row.get("hand")
        if k and h:
            chk = "ok" if row["check"]["ok"] else "CHECK FAILED"
            self.log(f"  {row['workload']:>4} {row['dtype']:>7} {row['row']:<32} "
                     f"kfac_ref {k['median_s'] * 1e3:9.2f} ms  hand {h['median_s'] * 1e3:9.2f} ms"
                     f"  ratio {row['ratio']:6.2f}  {chk}")

    def run_workload(self, wl, dtype):
        b, hp = self.b, self.b.hand
        host_x, host_y, host_params = host_problem(wl, dtype, self.seed)
        params = tuple(tuple(b.to(a) for a in p) for p in host_params)
        x, y = b.to(host_x), b.to(host_y)
        hparams = [tuple(b.hand_to(a) for a in p) for p in host_params if p]
        hx, hy = b.hand_to(host_x), b.hand_to(host_y)
        n = wl.in_shape[0]
        fa = (params, (x, y))
        est = BlockDiagonalCurvature(wl.net, ce)
        st0 = est.init(None, fa, approx_powers_to_cache=-1.0)
        base = {"workload": wl.name, "dtype": np.dtype(dtype).name, "backend": b.name}
        st = None
        for mode in self.modes:
            # agreement: the same output vectors through both pipelines
            seed = self.seed + 1
            st_m = est.update_curvature_matrix_estimate(st0, 0.0, 1.0, n,
                                                        np.random.default_rng(seed), fa, mode)
            u = np.stack([b.to_host(v) for v in estimation_output_vectors(
                wl.net, ce, params, (x, y), mode, np.random.default_rng(seed))])
            facs = wl.hand_update(hp, hparams, hx, hy, mode, None, vectors=b.hand_to(u))
            err = 0.0
            for bs, (a, g) in zip(st_m.blocks_states, facs, strict=True):
                ka, kg = (b.to_host(f.value) for f in bs.factors)
                err = max(err, rel_err(ka, _host(a)), rel_err(kg, _host(g)))
            terms = n * math.prod(wl.in_shape[1:-1]) * u.shape[0]
            check = _check(err, self.tol(dtype, terms))
            if mode == "ggn_exact" or st is None:
                st = st_m
            krng, hrng = np.random.default_rng(seed), np.random.default_rng(seed)
            t = time_pair(
                lambda mode=mode, krng=krng: est.update_curvature_matrix_estimate(
                    st0, 0.0, 1.0, n, krng, fa, mode),
                lambda mode=mode, hrng=hrng: wl.hand_update(hp, hparams, hx, hy, mode, hrng),
                self.repeats, b.sync)
            self._add({**base, "row": f"update {mode}", "op": "update", "mode": mode,
                       "vectors": int(u.shape[0]), **t,
                       "ratio": t["kfac_ref"]["median_s"] / t["hand"]["median_s"],
                       "check": check})
        self._inverse_rows(wl, dtype, est, st, base)

    def _inverse_rows(self, wl, dtype, est, st, base):
        b, hp = self.b, self.b.hand
        hfacs = [tuple(b.hand_to(b.to_host(f.value)) for f in bs.factors)
                 for bs in st.blocks_states]
        st_c = est.update_cache(st, DAMPING, None, -1.0, False)
        hinv = hand.pi_damped_inverses(hp, hfacs, DAMPING, wl.scales)
        rng = np.random.default_rng(self.seed + 2)
        host_v = rng.standard_normal(est.dim).astype(dtype)
        v, hv = b.to(host_v), b.hand_to(host_v)
        got = b.to_host(est.multiply_matpower(st_c, v, DAMPING, -1.0, False, True))
        want = _host(hand.cached_product(hp, hinv, hv))
        # inverses lose cond(damped factor)·eps: take the worst damped factor's
        cond = 1.0
        for _, da, dg in hand.pi_damped_factors(hp, hfacs, DAMPING, wl.scales):
            for f in (da, dg):
                w = np.linalg.eigvalsh(np.asarray(_host(f), dtype=np.float64))
                cond = max(cond, w[-1] / w[0])
        order = max(max(f.shape[0] for f in fs) for fs in hfacs)
        check = _check(rel_err(got, want), self.tol(dtype, order, cond))
        t = time_pair(lambda: est.update_cache(st, DAMPING, None, -1.0, False),
                      lambda: hand.pi_damped_inverses(hp, hfacs, DAMPING, wl.scales),
                      self.short_repeats, b.sync)
        self._add({**base, "row": "inverses (update_cache, power −1)", "op": "inverses", **t,
                   "ratio": t["kfac_ref"]["median_s"] / t["hand"]["median_s"], "check": check})
        t = time_pair(lambda: est.multiply_matpower(st_c, v, DAMPING, -1.0, False, True),
                      lambda: hand.cached_product(hp, hinv, hv), self.short_repeats, b.sync)
        self._add({**base, "row": "cached multiply_matpower (−1)", "op": "cached_product", **t,
                   "ratio": t["kfac_ref"]["median_s"] / t["hand"]["median_s"], "check": check})

    def conv_memory_rows(self, dtype):
        """Peak traced memory of the KFC input factor (NumPy only: tracemalloc sees NumPy's
        allocations, not a device's)."""
        if self.b.name != "numpy":
            return
        c_in, size, batches = (4, 8, (2, 4)) if self.quick else (32, 32, (32, 128))
        rng = np.random.default_rng(self.seed + 3)
        for n in batches:
            x = rng.standard_normal((n, size, size, c_in)).astype(dtype)
            shape = (3, 3, c_in, 2 * c_in)
            args = (shape, "SAME", (1, 2, 2, 1), (1, 1, 1, 1), "NHWC", True)
            got = conv_input_kronecker_factor(x, *args)
            want = hand.conv_input_factor(np, x, 3, 2)
            rows = n * (-(-size // 2)) ** 2
            check = _check(rel_err(got, want), self.tol(dtype, rows))
            peaks = {}
            for who, fn in (("kfac_ref", lambda x=x, a=args: conv_input_kronecker_factor(x, *a)),
                            ("hand", lambda x=x: hand.conv_input_factor(np, x, 3, 2))):
                tracemalloc.start()
                fn()
                peaks[who] = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
            im2col = rows * (9 * c_in + 1) * np.dtype(dtype).itemsize
            self.rows.append({
                "workload": "cnn", "dtype": np.dtype(dtype).name, "backend": "numpy",
                "row": f"conv input factor memory, N={n}", "op": "conv_memory", "batch": n,
                "input_shape": [n, size, size, c_in], "im2col_bytes": im2col,
                "kfac_ref_peak_bytes": peaks["kfac_ref"], "hand_peak_bytes": peaks["hand"],
                "ratio": peaks["kfac_ref"] / peaks["hand"], "check": check})
            self.log(f"   cnn {np.dtype(dtype).name:>7} conv input factor memory N={n:<4}"
                     f"        kfac_ref {peaks['kfac_ref'] / 2**20:8.1f} MiB  hand "
                     f"{peaks['hand'] / 2**20:8.1f} MiB (im2col {im2col / 2**20:.1f} MiB)")

    def chunking_rows(self, dtype):
        """Chunked (8 MiB) against one-shot kfac_ref on the CNN's second convolution."""
        b = self.b
        c_in, size, n = (4, 8, 8) if self.quick else (32, 32, 128)
        budget = 2**13 if self.quick else 8 * 2**20
        one_shot = 2**62
        rng = np.random.default_rng(self.seed + 4)
        x = b.to(rng.standard_normal((n, size, size, c_in)).astype(dtype))
        half = -(-size // 2)
        g = b.to(rng.standard_normal((n, half, half, 2 * c_in)).astype(dtype))
        w = b.to(rng.standard_normal((3, 3, c_in, 2 * c_in)).astype(dtype))
        args = ((3, 3, c_in, 2 * c_in), "SAME", (1, 2, 2, 1), (1, 1, 1, 1), "NHWC", True)
        layers = {bound: nn.Conv2D(c_in, 2 * c_in, 3, stride=2, padding="SAME", use_bias=False,
                                   max_temporary_bytes=bound) for bound in (budget, one_shot)}

        def backward(bound):
            layer = layers[bound]
            return layer.vjp_input((w,), x, g), layer.param_grads((w,), x, g)[0]

        entries = n * half * half * (9 * c_in + 1)
        base = {"workload": "cnn", "dtype": np.dtype(dtype).name, "backend": b.name,
                "op": "chunking", "batch": n, "budget_bytes": budget}
        for row, run, terms in (
                ("conv input factor, 8 MiB chunks", lambda bound: conv_input_kronecker_factor(
                    x, *args, max_temporary_bytes=bound), n * half * half),
                ("Conv2D backward, 8 MiB chunks", backward, 9 * 2 * c_in)):
            got, want = run(budget), run(one_shot)
            got, want = (got,) if not isinstance(got, tuple) else got, (
                (want,) if not isinstance(want, tuple) else want)
            err = max(rel_err(b.to_host(a), b.to_host(c)) for a, c in zip(got, want, strict=True))
            check = _check(err, self.tol(dtype, terms))
            t = time_pair(lambda run=run: run(budget), lambda run=run: run(one_shot),
                          self.repeats, b.sync)
            self._add({**base, "row": row, **t, "im2col_bytes": entries * np.dtype(dtype).itemsize,
                       "ratio": t["kfac_ref"]["median_s"] / t["hand"]["median_s"],
                       "check": check})

    def peer_rows(self, wl, dtype):
        """Full updates against each installed peer (:mod:`benchmarks.peers`)."""
        peers.peer_rows(self, wl, dtype)

    def missing_peer_rows(self):
        self.rows.extend(peers.missing_rows())


def _host(a):
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


# --------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------
def meta(args, backend):
    return {
        "schema_version": SCHEMA_VERSION,
        "kfac_ref_version": kfac_ref.__version__,
        "numpy_version": np.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "backend": backend.name,
        "hand": backend.hand.__name__,  # the array library of the hand baseline
        "quick": bool(args.quick),
        "repeats": args.repeats,
        "damping": DAMPING,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _ms(s):
    return f"{s['median_s'] * 1e3:,.2f} ({s['q1_s'] * 1e3:,.2f}–{s['q3_s'] * 1e3:,.2f})"


def _row(*cells):
    """One row of a Markdown table."""
    return "| " + " | ".join(cells) + " |"


def _verdict(r):
    return "ok" if r["check"]["ok"] else "**FAILED**"


def markdown(result):
    m = result["meta"]
    lines = [f"kfac_ref {m['kfac_ref_version']}, backend {m['backend']}, NumPy "
             f"{m['numpy_version']}, {m['cpu_count']} CPUs, {m['repeats']} repeats "
             f"({short_repeats(m['repeats'])} for the inverses and cached products; median and "
             f"interquartile range, ms){' — QUICK sizes' if m['quick'] else ''}.",
             "(The `chunking` rows compare kfac_ref with an 8 MiB memory bound against kfac_ref "
             "in one shot: there the second column is kfac_ref unchunked.)",
             "", f"| workload | dtype | row | kfac_ref | hand ({m.get('hand', 'numpy')}) "
             "| ratio | check |",
             "|---|---|---|---:|---:|---:|---|"]
    for r in result["rows"]:
        if r["op"] in ("update", "inverses", "cached_product", "chunking"):
            lines.append(_row(r["workload"], r["dtype"], r["row"], _ms(r["kfac_ref"]),
                              _ms(r["hand"]), f"{r['ratio']:.2f}×", _verdict(r)))
    mem = [r for r in result["rows"] if r["op"] == "conv_memory"]
    if mem:
        lines += ["", "| conv input factor (peak traced memory) | dtype | kfac_ref MiB | "
                  "hand MiB | im2col MiB | ratio | check |", "|---|---|---:|---:|---:|---:|---|"]
        for r in mem:
            mib = (f"{r[k] / 2**20:.1f}"
                   for k in ("kfac_ref_peak_bytes", "hand_peak_bytes", "im2col_bytes"))
            lines.append(_row(f"{r['input_shape']}, 3×3 stride 2", r["dtype"], *mib,
                              f"{r['ratio']:.2f}×", _verdict(r)))
    prows = [r for r in result["rows"] if r["op"] == "peer"]
    if prows:
        lines += ["", "Full update (factors, damped inverses, one product) against a peer; "
                  "ratio kfac_ref / peer (below 1: kfac_ref faster); check: the peer's "
                  "ggn_exact factors against kfac_ref's.", "",
                  "| workload | dtype | peer | mode | kfac_ref on | peer on | kfac_ref | peer "
                  "| ratio | check |", "|---|---|---|---|---|---|---:|---:|---:|---|"]
        for r in prows:
            lines.append(_row(r["workload"], r["dtype"], r["peer"], r["mode"],
                              r.get("backend", "numpy"), r.get("peer_on", "cpu"),
                              _ms(r["kfac_ref"]),
                              _ms(r["peer_time"]), f"{r['ratio']:.2f}×", _verdict(r)))
    missing = [r for r in result["rows"] if r["op"] == "peer_missing"]
    if missing:
        lines += [""] + [f"- {r['peer']}: {r['status']}" for r in missing]
    return "\n".join(lines) + "\n"


def write(result, out):
    os.makedirs(out, exist_ok=True)
    tag = f"{result['meta']['backend']}{'-quick' if result['meta']['quick'] else ''}"
    jpath = os.path.join(out, f"bench-{tag}.json")
    mpath = os.path.join(out, f"bench-{tag}.md")
    with open(jpath, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    text = markdown(result)
    with open(mpath, "w", encoding="utf-8") as fh:
        fh.write(text)
    return jpath, mpath, text
