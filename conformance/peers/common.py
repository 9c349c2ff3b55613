"""Fixed float64 problems and their reference K-FAC quantities for the peer reproductions.

Everything here is NumPy on the host plus :mod:`kfac_ref.linalg` (``compute_cov``,
``append_homog``, ``kron``, ``pi_tracenorm``, ``kron_damped_inverse_matvec``).  The per-example
activations ``a`` and back-propagated vectors ``g`` are computed by hand (explicit chain rule
for a tanh MLP and a conv → tanh → dense net), so the reference factors do not depend on any
framework's autodiff.

Canonical conventions (the docs page *Conventions*): TF/JAX layouts (``s = a @ W + b``,
W [d_in, d_out], conv NHWC/HWIO, patch order (kh, kw, C_in) with C_in fastest), homogeneous
coordinate last, ``A = (1/N) Σ ā āᵀ``, ``G = (1/N) Σ g gᵀ`` for the curvature of the MEAN loss
with per-example loss ``ℓ_n``: squared error ``½‖f − y‖²`` (unit variance) or softmax
cross-entropy.  Type-2 / exact Fisher: ``G = (1/N) Σ_n Σ_k g_{n,k} g_{n,k}ᵀ`` where
``g_{n,k}`` back-propagates column k of a square root of the per-example output Hessian.
Empirical Fisher: ``g_n = ∇_s ℓ_n(y_n)``.  Conv (KFC): both factors over the N·|T| rows,
block ``|T|·kron(A, G)``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys

import numpy as np

from kfac_ref import linalg as L

# ---------------------------------------------------------------------------------------------
# problems


def mlp_problem(n=4, dims=(3, 5, 4), seed=0):
    """Two dense layers: s1 = x W1 + b1, h = tanh(s1), f = h W2 + b2 (TF layout)."""
    rng = np.random.default_rng(seed)
    d0, d1, d2 = dims
    return {
        "x": rng.standard_normal((n, d0)),
        "W1": rng.standard_normal((d0, d1)) / math.sqrt(d0),
        "b1": 0.1 * rng.standard_normal(d1),
        "W2": rng.standard_normal((d1, d2)) / math.sqrt(d1),
        "b2": 0.1 * rng.standard_normal(d2),
        "y_reg": rng.standard_normal((n, d2)),
        "y_cls": rng.integers(0, d2, size=n),
    }


def mlp_dims(p):
    """The MLP problem's layers' (d_in, d_out)."""
    (d0, d1), d2 = p["W1"].shape, p["W2"].shape[1]
    return [(d0, d1), (d1, d2)]


def mlp_forward(p, bias=True):
    b1 = p["b1"] if bias else 0.0
    b2 = p["b2"] if bias else 0.0
    s1 = p["x"] @ p["W1"] + b1
    h = np.tanh(s1)
    f = h @ p["W2"] + b2
    return s1, h, f


def softmax(f):
    z = f - f.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def output_sqrt_columns(loss, f):
    """[N, C, K]: columns of a square root S_n (S_n S_nᵀ = ∂²ℓ_n/∂f²) per example."""
    n, c = f.shape
    if loss == "mse":  # ½‖f − y‖² has Hessian I
        return np.broadcast_to(np.eye(c), (n, c, c)).copy()
    if loss == "ce":  # H = diag(p) − p pᵀ = S Sᵀ with S[:, k] = (e_k − p)·√p_k
        pr = softmax(f)
        eye = np.eye(c)[None]
        return (eye - pr[:, :, None]) * np.sqrt(pr)[:, None, :]
    raise ValueError(loss)


def output_gradient(loss, f, p):
    """[N, C]: ∇_f ℓ_n at the data targets."""
    if loss == "mse":
        return f - p["y_reg"]
    if loss == "ce":
        return softmax(f) - np.eye(f.shape[1])[p["y_cls"]]
    raise ValueError(loss)


def mlp_backprop(p, h, v):
    """Back-propagate output-space vectors v [N, ..., C] to (g1, g2) at s1 and s2."""
    g2 = v
    g1 = (
        (v @ p["W2"].T) * (1.0 - h**2)[:, None, :]
        if v.ndim == 3
        else (v @ p["W2"].T) * (1.0 - h**2)
    )
    return g1, g2


def _cov_sum_columns(g):
    """(1/N) Σ_n Σ_k g[n, k] g[n, k]ᵀ for g [N, K, d] (columns summed, batch averaged)."""
    n = g.shape[0]
    return (
        sum(L.compute_cov(np.ascontiguousarray(g[:, k, :])) for k in range(g.shape[1]))
        if n
        else None
    )


def mlp_reference(p, loss, fisher, bias=True):
    """Reference (A, G) per layer [(A1, G1), (A2, G2)] in canonical conventions.

    fisher: "type2" (exact GGN / exact Fisher) or "empirical".
    """
    s1, h, f = mlp_forward(p, bias)
    inputs = [p["x"], h]
    if fisher == "type2":
        cols = output_sqrt_columns(loss, f)  # [N, C, K]
        v = np.transpose(cols, (0, 2, 1))  # [N, K, C]: one output vector per column
        g1, g2 = mlp_backprop(p, h, v)
        gs = [_cov_sum_columns(g1), _cov_sum_columns(g2)]
    elif fisher == "empirical":
        v = output_gradient(loss, f, p)
        g1, g2 = mlp_backprop(p, h, v)
        gs = [L.compute_cov(g1), L.compute_cov(g2)]
    else:
        raise ValueError(fisher)
    out = []
    for a, g in zip(inputs, gs, strict=False):
        a_cov = L.compute_cov(L.append_homog(a)) if bias else L.compute_cov(a)
        out.append((np.asarray(a_cov), np.asarray(g)))
    return out


def mlp_exact_ggn_blocks(p, loss, bias=True):
    """Exact per-layer GGN blocks of the mean loss, canonical row-major vec of [W; b]."""
    s1, h, f = mlp_forward(p, bias)
    n = f.shape[0]
    cols = output_sqrt_columns(loss, f)
    v = np.transpose(cols, (0, 2, 1))
    g1, g2 = mlp_backprop(p, h, v)
    blocks = []
    for a, g in ((p["x"], g1), (h, g2)):
        ab = np.concatenate([a, np.ones((n, 1))], 1) if bias else a
        # per-example, per-column gradient of [W; b] flattened row-major: ā ⊗ g
        j = np.einsum("ni,nkj->nkij", ab, g).reshape(n, g.shape[1], -1)
        blocks.append(np.einsum("nkp,nkq->pq", j, j) / n)
    return blocks


# -- conv problem: conv (NHWC, HWIO, VALID, stride 1) -> tanh -> flatten (NHWC order) -> dense


def conv_problem(n=2, hw=(4, 4), c_in=2, c_out=3, k=(2, 2), classes=3, seed=1):
    rng = np.random.default_rng(seed)
    oh, ow = hw[0] - k[0] + 1, hw[1] - k[1] + 1
    d_flat = oh * ow * c_out
    return {
        "x": rng.standard_normal((n, hw[0], hw[1], c_in)),
        "K": rng.standard_normal((k[0], k[1], c_in, c_out)) / math.sqrt(k[0] * k[1] * c_in),
        "bc": 0.1 * rng.standard_normal(c_out),
        "W": rng.standard_normal((d_flat, classes)) / math.sqrt(d_flat),
        "b": 0.1 * rng.standard_normal(classes),
        "y_reg": rng.standard_normal((n, classes)),
        "y_cls": rng.integers(0, classes, size=n),
        "out_hw": (oh, ow),
    }


def conv_patches(p):
    """[N, T, kh·kw·C_in] patches (kh, kw, C_in), C_in fastest; VALID, stride 1 (loops)."""
    x, kk = p["x"], p["K"]
    n, _, _, c = x.shape
    kh, kw = kk.shape[:2]
    oh, ow = p["out_hw"]
    out = np.zeros((n, oh * ow, kh * kw * c))
    for i in range(oh):
        for j in range(ow):
            out[:, i * ow + j, :] = x[:, i : i + kh, j : j + kw, :].reshape(n, -1)
    return out


def conv_forward(p, bias=True):
    pt = conv_patches(p)
    kk = p["K"]
    s = pt @ kk.reshape(-1, kk.shape[-1]) + (p["bc"] if bias else 0.0)  # [N, T, C_out]
    h = np.tanh(s)
    f = h.reshape(h.shape[0], -1) @ p["W"] + (p["b"] if bias else 0.0)
    return pt, s, h, f


def conv_reference(p, loss, fisher, bias=True):
    """Conv factors: dict with KFC (A, G), expand (A, G) and reduce (A, G) of the conv layer,
    and the dense layer's (A, G); canonical patch order; mean-loss curvature."""
    pt, s, h, f = conv_forward(p, bias)
    n, t, _ = pt.shape
    if fisher == "type2":
        v = np.transpose(output_sqrt_columns(loss, f), (0, 2, 1))  # [N, K, C]
    else:
        v = output_gradient(loss, f, p)[:, None, :]  # [N, 1, C]
    gh = (v @ p["W"].T).reshape(n, v.shape[1], t, -1)  # [N, K, T, C_out]
    gs = gh * (1.0 - h**2)[:, None]  # at the conv pre-activation
    pa = np.concatenate([pt, np.ones((n, t, 1))], -1) if bias else pt
    rows_a = pa.reshape(n * t, -1)
    a_kfc = np.asarray(L.compute_cov(rows_a))  # Σ_{n,t} ā āᵀ / (N T)
    g_kfc = sum(np.asarray(L.compute_cov(gs[:, k].reshape(n * t, -1))) for k in range(v.shape[1]))
    a_mean = pa.mean(1)  # [N, P] location-averaged patches
    g_sum = gs.sum(2)  # [N, K, C_out] location-summed gradients
    a_red = np.asarray(L.compute_cov(a_mean))
    g_red = sum(np.asarray(L.compute_cov(g_sum[:, k])) for k in range(v.shape[1]))
    hf = h.reshape(n, -1)
    a_d = np.asarray(L.compute_cov(L.append_homog(hf) if bias else hf))
    g_d = sum(np.asarray(L.compute_cov(np.ascontiguousarray(v[:, k]))) for k in range(v.shape[1]))
    return {
        "T": t,
        "kfc": (a_kfc, g_kfc),  # block T·kron(A, G)
        "expand": (a_kfc, t * g_kfc),  # block kron(A, G), A over N·T, G summed over t
        "reduce": (a_red, g_red),
        "dense": (a_d, g_d),
    }


# ---------------------------------------------------------------------------------------------
# convention maps


def torch_conv_perm(kh, kw, c_in):
    """Index map: entry j of PyTorch's unfold order (c, i, j; channel slowest) is entry
    perm[j] of the canonical (i, j, c; channel fastest) patch order."""
    return np.array(
        [(i * kw + j) * c_in + c for c in range(c_in) for i in range(kh) for j in range(kw)]
    )


def torch_flatten_perm(oh, ow, c):
    """Entry j of an NCHW flatten (c, h, w) is entry perm[j] of the NHWC flatten (h, w, c)."""
    return np.array(
        [(i * ow + j) * c + cc for cc in range(c) for i in range(oh) for j in range(ow)]
    )


def bias_first(m):
    """Move the homogeneous coordinate from last to first (rows and columns)."""
    idx = np.concatenate([[m.shape[0] - 1], np.arange(m.shape[0] - 1)])
    return m[np.ix_(idx, idx)]


# ---------------------------------------------------------------------------------------------
# comparison and reporting


def rel_err(actual, expected):
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        return float("inf")
    den = np.linalg.norm(expected)
    num = np.linalg.norm(actual - expected)
    if not np.isfinite(num):
        return float("nan")
    return float(num / den) if den > 0 else float(num)


def best_scale(actual, expected):
    """Least-squares scalar c with actual ≈ c·expected and the residual after it."""
    a = np.asarray(actual, dtype=np.float64).ravel()
    e = np.asarray(expected, dtype=np.float64).ravel()
    if a.shape != e.shape or not np.any(e):
        return float("nan"), float("nan")
    c = float(a @ e / (e @ e))
    return c, rel_err(c * e, a) if np.any(a) else float("nan")


class Report:
    """Collects rows (peer, quantity, relative error, tolerance, verdict, note)."""

    def __init__(self, peer, version):
        self.peer, self.version, self.rows = peer, version, []

    def check(self, quantity, actual, expected, tol, convention="", note=""):
        err = rel_err(actual, expected)
        c, resid = best_scale(actual, expected)
        ok = bool(np.isfinite(err) and err <= tol)
        row = {
            "quantity": quantity,
            "rel_err": err,
            "tol": tol,
            "verdict": "agree" if ok else "DISAGREE",
            "convention": convention,
            "best_scale": c,
            "residual_after_scale": resid,
            "note": note,
        }
        self.rows.append(row)
        print(
            f"{row['verdict']:9s} {quantity:58s} rel_err={err:9.2e} (tol {tol:.0e})"
            + ("" if ok else f"  best scale {c:.6g}, residual {resid:.2e}")
            + (f"  [{convention}]" if convention else "")
            + (f"  {note}" if note else "")
        )
        sys.stdout.flush()
        return ok

    def diagnose(self, quantity, actual, alternatives, tol):
        """Name the alternatives (dict name -> expected array) that ``actual`` matches."""
        errs = {k: rel_err(actual, v) for k, v in alternatives.items()}
        hits = [k for k, e in errs.items() if np.isfinite(e) and e <= tol]
        text = (
            ("matches " + ", ".join(hits) if hits else "matches none of the alternatives")
            + " ("
            + "; ".join(f"{k}: {e:.2e}" for k, e in errs.items())
            + ")"
        )
        self.rows.append(
            {
                "quantity": quantity,
                "verdict": "diagnosis",
                "matches": hits,
                "errors": errs,
                "note": text,
            }
        )
        print(f"{'diagnose':9s} {quantity:58s} {text}")
        return hits

    def note(self, quantity, text):
        self.rows.append({"quantity": quantity, "verdict": "note", "note": text})
        print(f"{'note':9s} {quantity:58s} {text}")

    def skip(self, quantity, reason):
        self.rows.append({"quantity": quantity, "verdict": "skip", "note": reason})
        print(f"{'skip':9s} {quantity:58s} {reason}")

    def dump(self, path=None):
        out = {
            "peer": self.peer,
            "version": self.version,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "rows": self.rows,
        }
        if path:
            with open(path, "w") as fh:
                json.dump(out, fh, indent=1, default=float)
        n_bad = sum(r["verdict"] == "DISAGREE" for r in self.rows)
        print(
            f"# {self.peer} {self.version}: {sum(r['verdict'] == 'agree' for r in self.rows)}"
            f" agree, {n_bad} disagree, {sum(r['verdict'] == 'skip' for r in self.rows)} skip"
        )
        return out


def run_checks(argv, peer, version, *checks):
    """A reproduction script's command line: run each ``check(report)`` in order on one
    :class:`Report` and print its summary; ``--json PATH`` also writes the rows there."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rep = Report(peer, version)
    for check in checks:
        check(rep)
    return rep.dump(args.json)


def print_verdicts(rows, tol, control_gap=1e-3):
    """Print one verdict per ``(name, err)`` row of a peer check and a summary; a row with
    ``err < 0`` is a control whose relative difference ``-err`` must exceed ``control_gap``,
    any other row must agree to ``tol``.  Returns the exit status (0 when every row holds)."""
    ok, worst = True, 0.0
    for name, err in rows:
        if err < 0:
            good = -err > control_gap
            print(f"{'differs' if good else 'SAME?':9s} {name}: rel. difference {-err:.2e}")
        else:
            good = err <= tol
            worst = max(worst, err)
            print(f"{'agree' if good else 'DISAGREE':9s} {name}: rel. error {err:.2e}")
        ok &= good
    n_cmp = sum(err >= 0 for _, err in rows)
    print(f"{n_cmp} comparisons, worst rel. error {worst:.2e}; {len(rows) - n_cmp} controls")
    return 0 if ok else 1
