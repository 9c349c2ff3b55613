"""Factor capabilities (TF K-FAC's fisher_factors): dense and convolution Kronecker factors,
diagonal factors, embedding, naive diagonal, the multi-use lag-one moment.

Inputs are per-example quantities in canonical layouts: dense inputs ``a`` [N, d_in], back-
propagated vectors ``g`` [N, d_out] (gradients of the per-example loss, no 1/N); convolution
inputs NHWC (or NCHW where the case says ``data_format``), kernels described by
``filter_shape = [kh, kw, C_in, C_out]`` (HWIO), output gradients in the input's layout.

Tolerance derivation: every factor is a second moment over M rows (M = N for dense layers,
N·|T| for convolutions), each entry a length-M dot product of O(1) data: work = M, κ = 1;
diagonal factors add a length-|T| sum per example: work = N·|T|.
"""

from __future__ import annotations

import numpy as np

from ..conventions import a_index
from ..model import SAFETY, Capability, Case, Tolerance, rng_for
from ._data import to_np

REQUIRES = ("kfac_ref.factors", "kfac_ref.patches")


# -- conversions ----------------------------------------------------------------------------
def _a_idx(case, conv, rows=False):
    """A-side index map; ``rows=True`` for parameter-shaped [p, q] arrays, where a separate
    bias is still the last row."""
    m = case.meta
    patch = (tuple(m["kernel"]), m["c_in"]) if "kernel" in m else None
    pos = "last" if rows and conv.bias_position == "separate" else conv.bias_position
    return a_index(m["p"], pos, m.get("bias", False), patch, conv.patch_order)


def _sum_scale(case, conv):
    return float(case.meta["N"]) if conv.curvature_of == "sum" else 1.0


def _input_factor(arr, case, conv):
    idx = _a_idx(case, conv)
    return arr[np.ix_(idx, idx)]


def _output_factor(arr, case, conv):
    return arr * _sum_scale(case, conv)


def _diag_factor(arr, case, conv):
    out = arr[_a_idx(case, conv, rows=True), :] * _sum_scale(case, conv)
    return out.T if conv.kron_order == "GA" else out


def _conv_input(arr, case, conv):
    style = conv.conv_style
    if style == "reduce":
        arr = case.alternatives["reduce_factor"]
    elif style == "hybrid":
        arr = arr * case.meta["T"]
    return _input_factor(arr, case, conv)


def _conv_output(arr, case, conv):
    style = conv.conv_style
    if style == "expand":
        arr = arr * case.meta["T"]
    elif style in ("reduce", "hybrid"):
        arr = case.alternatives["reduce_factor"]
    return _output_factor(arr, case, conv)


_CONV_PARAMS = ("params: filter_shape [kh, kw, C_in, C_out], padding ('SAME', 'VALID' or "
                "[[lo, hi], [lo, hi]]), strides [sh, sw], dilation [dh, dw], data_format "
                "('NHWC'/'NCHW')")

CAPABILITIES = [
    Capability(
        "factors.dense_input",
        "Input factor A = (1/M) Σ ā āᵀ of a dense layer (ā = [a, 1] with has_bias); "
        "[d_in(+1)]². A [T, N, d] input is a multiply-used layer folded to M = T·N rows.",
        "inputs: a [N, d_in] or [T, N, d_in]; params: has_bias",
        ("bias_position", "symmetrised"),
        convert_output=_input_factor,
    ),
    Capability(
        "factors.dense_output",
        "Output factor G = (1/M) Σ g gᵀ of a dense layer from per-example back-propagated "
        "vectors (no 1/N in g); [d_out, d_out].",
        "inputs: g [N, d_out] or [T, N, d_out]",
        ("curvature_of", "symmetrised"),
        convert_output=_output_factor,
    ),
    Capability(
        "factors.dense_diagonal",
        "Exact diagonal of the per-example second moment, (1/N)(ā∘ā)ᵀ(g∘g), in the shape of "
        "[W; b] ([d_in(+1), d_out]; transposed for kron_order GA).",
        "inputs: a [N, d_in], g [N, d_out]; params: has_bias",
        ("bias_position", "kron_order", "curvature_of"),
        convert_output=_diag_factor,
    ),
    Capability(
        "factors.conv_input",
        "KFC input factor Ω = (1/(N|T|)) Σ_{n,t} p̄ p̄ᵀ over patch vectors (zero padding "
        "included, ones column last); [kh·kw·C_in(+1)]².",
        f"inputs: x [N, H, W, C_in] (or NCHW); {_CONV_PARAMS}, has_bias",
        ("bias_position", "patch_order", "conv_style", "symmetrised"),
        convert_output=_conv_input,
    ),
    Capability(
        "factors.conv_output",
        "KFC output factor Γ = (1/(N|T|)) Σ_{n,t} g gᵀ over output locations; [C_out, C_out].",
        "inputs: g [N, Ho, Wo, C_out] (or NCHW); params: data_format",
        ("conv_style", "curvature_of", "symmetrised"),
        convert_output=_conv_output,
    ),
    Capability(
        "factors.conv_diagonal",
        "Exact diagonal (1/N) Σ_n (Σ_t p̄_{n,t} g_{n,t}ᵀ)^∘2 of a convolution's per-example "
        "gradient second moment; [kh·kw·C_in(+1), C_out].",
        f"inputs: x, g; {_CONV_PARAMS}, has_bias",
        ("bias_position", "patch_order", "kron_order", "curvature_of"),
        convert_output=_diag_factor,
    ),
    Capability(
        "factors.embedding_input",
        "Diagonal input factor of an embedding: id frequencies (1/N) Σ_n Σ_j [id_nj = v]; [V].",
        "inputs: ids (integer) [N] or [N, S]; params: vocab_size",
    ),
    Capability(
        "factors.naive_diagonal",
        "Naive diagonal Fisher (Σ_n ĝ_n)^∘2 / N from the gradient of the summed loss; [P].",
        "inputs: grad [P]; params: batch_size",
    ),
    Capability(
        "factors.series_cov_dt1",
        "Lag-one cross moment of a multiply-used dense layer, C₁ = (1/(T·B)) Σ_t Σ_b "
        "x̄_{t+1,b} x̄_{t,b}ᵀ (future × present, not symmetrised); [d(+1)]².",
        "inputs: x [T, B, d]; params: num_uses, has_bias",
        ("bias_position",),
        convert_output=_input_factor,
    ),
]


def _tol(rows, what):
    return Tolerance(SAFETY * rows, f"{what}: length-{rows} dot products, work = {rows}, κ = 1")


def build_cases() -> list[Case]:
    from kfac_ref import factors as F
    from kfac_ref import patches as P

    cases = []

    # dense -----------------------------------------------------------------------------
    for shape, bias in (((3, 4), True), ((3, 4), False), ((2, 3, 3), True)):
        tag = "x".join(map(str, shape))
        cid = f"factors.dense_input/{tag}_bias{int(bias)}"
        a = rng_for(cid).standard_normal(shape)
        m = int(np.prod(shape[:-1]))
        cases.append(Case(cid, "factors.dense_input", {"a": a}, {"has_bias": bias},
                          to_np(F.fully_connected_kronecker_factor(a, has_bias=bias)),
                          _tol(m, f"M = {m} rows"),
                          {"N": shape[-2], "p": shape[-1] + bias, "bias": bias},
                          description="multi-use [T, N, d]" if len(shape) == 3 else ""))
    for shape in ((3, 4), (2, 3, 2)):
        tag = "x".join(map(str, shape))
        cid = f"factors.dense_output/{tag}"
        g = rng_for(cid).standard_normal(shape)
        m = int(np.prod(shape[:-1]))
        cases.append(Case(cid, "factors.dense_output", {"g": g}, {},
                          to_np(F.fully_connected_kronecker_factor(g)),
                          _tol(m, f"M = {m} rows"), {"N": shape[-2]}))
    for bias in (True, False):
        cid = f"factors.dense_diagonal/n3_in4_out2_bias{int(bias)}"
        r = rng_for(cid)
        a, g = r.standard_normal((3, 4)), r.standard_normal((3, 2))
        cases.append(Case(cid, "factors.dense_diagonal", {"a": a, "g": g}, {"has_bias": bias},
                          to_np(F.fully_connected_diagonal_factor(a, g, has_bias=bias)),
                          _tol(3, "N = 3 rows"), {"N": 3, "p": 4 + bias, "bias": bias}))

    # convolutions ----------------------------------------------------------------------
    # (name, input spatial, kernel, c_in, c_out, padding, strides, dilation, data_format)
    geoms = [
        ("same_s1", (5, 5), (3, 3), 2, 3, "SAME", (1, 1), (1, 1), "NHWC"),
        ("valid_s1", (5, 4), (2, 3), 2, 2, "VALID", (1, 1), (1, 1), "NHWC"),
        ("same_s2", (7, 5), (3, 3), 2, 2, "SAME", (2, 2), (1, 1), "NHWC"),
        ("explicit_pad", (5, 4), (3, 2), 1, 2, [[1, 0], [0, 2]], (1, 2), (1, 1), "NHWC"),
        ("valid_dilated", (6, 6), (2, 2), 2, 2, "VALID", (1, 1), (2, 2), "NHWC"),
        ("same_nchw", (5, 5), (3, 3), 2, 3, "SAME", (1, 1), (1, 1), "NCHW"),
    ]
    n = 3
    for name, hw, k, c_in, c_out, pad, strides, dil, fmt in geoms:
        fshape = [k[0], k[1], c_in, c_out]
        in_shape = (n, *hw, c_in) if fmt == "NHWC" else (n, c_in, *hw)
        params = {"filter_shape": fshape, "padding": pad, "strides": list(strides),
                  "dilation": list(dil), "data_format": fmt}
        out_hw = P.conv_output_spatial_shape(in_shape, fshape, strides, pad, dil, fmt)
        t = int(np.prod(out_hw))
        d = k[0] * k[1] * c_in
        for bias in ((True, False) if name == "same_s1" else (True,)):
            cid = f"factors.conv_input/{name}_bias{int(bias)}"
            x = rng_for(cid).standard_normal(in_shape)
            omega = F.conv_input_kronecker_factor(x, fshape, pad, strides, dil, fmt,
                                                  has_bias=bias)
            # KFAC-reduce input factor (location-averaged patches), from the same patches.
            pm = F.conv_patch_matrix(x, fshape, pad, strides, dil, fmt, has_bias=False)
            mean_p = np.mean(to_np(pm).reshape(n, t, d), axis=1)
            reduce_a = F.fully_connected_kronecker_factor(mean_p, has_bias=bias)
            cases.append(Case(
                cid, "factors.conv_input", {"x": x}, dict(params, has_bias=bias),
                to_np(omega), _tol(n * t, f"N·|T| = {n}·{t} patch rows"),
                {"N": n, "T": t, "p": d + bias, "bias": bias, "kernel": list(k), "c_in": c_in},
                {"reduce_factor": to_np(reduce_a)},
                f"{fmt}, padding {pad}, strides {strides}, dilation {dil}, |T| = {t}"))
        if name in ("same_s1", "same_s2", "same_nchw"):
            cid = f"factors.conv_output/{name}"
            g_shape = (n, *out_hw, c_out) if fmt == "NHWC" else (n, c_out, *out_hw)
            g = rng_for(cid).standard_normal(g_shape)
            gamma = F.conv_output_kronecker_factor(g, fmt)
            g_last = g if fmt == "NHWC" else np.moveaxis(g, 1, -1)
            reduce_g = F.fully_connected_kronecker_factor(
                g_last.reshape(n, t, c_out).sum(axis=1))
            cases.append(Case(
                cid, "factors.conv_output", {"g": g}, {"data_format": fmt}, to_np(gamma),
                _tol(n * t, f"N·|T| = {n}·{t} rows"), {"N": n, "T": t},
                {"reduce_factor": to_np(reduce_g)}, f"{fmt}, |T| = {t}"))
        if name in ("same_s2", "valid_dilated"):
            cid = f"factors.conv_diagonal/{name}"
            r = rng_for(cid)
            x = r.standard_normal(in_shape)
            g_shape = (n, *out_hw, c_out) if fmt == "NHWC" else (n, c_out, *out_hw)
            g = r.standard_normal(g_shape)
            diag = F.conv_diagonal_factor(x, g, fshape, strides, pad, fmt, dil, has_bias=True)
            cases.append(Case(
                cid, "factors.conv_diagonal", {"x": x, "g": g}, dict(params, has_bias=True),
                to_np(diag), _tol(n * t, f"N·|T| = {n}·{t}"),
                {"N": n, "T": t, "p": d + 1, "bias": True, "kernel": list(k), "c_in": c_in},
                description=f"{fmt}, padding {pad}, strides {strides}, dilation {dil}"))

    # embedding, naive diagonal, series -------------------------------------------------
    for shape in ((6,), (4, 3)):
        cid = f"factors.embedding_input/ids{'x'.join(map(str, shape))}_vocab5"
        ids = rng_for(cid).integers(0, 5, size=shape).astype(np.int64)
        cases.append(Case(cid, "factors.embedding_input", {"ids": ids}, {"vocab_size": 5},
                          to_np(F.embedding_input_kronecker_factor(ids, 5)),
                          Tolerance(SAFETY * ids.size, f"counts of {ids.size} ids / N: "
                                                       f"work = {ids.size}"),
                          {"N": shape[0]},
                          description="several ids per example (co-occurrences dropped)"
                          if len(shape) == 2 else ""))
    cid = "factors.naive_diagonal/p7_n4"
    grad = rng_for(cid).standard_normal(7)
    cases.append(Case(cid, "factors.naive_diagonal", {"grad": grad}, {"batch_size": 4},
                      to_np(F.naive_diagonal_factor(grad, 4)),
                      Tolerance(SAFETY, "one square and one division per entry: work = 1"),
                      {"N": 4}))
    for bias in (True, False):
        cid = f"factors.series_cov_dt1/t3_b2_d3_bias{int(bias)}"
        x = rng_for(cid).standard_normal((3, 2, 3))
        cases.append(Case(cid, "factors.series_cov_dt1", {"x": x},
                          {"num_uses": 3, "has_bias": bias},
                          to_np(F.fully_connected_multi_kf_cov_dt1(x, 3, has_bias=bias)),
                          _tol(6, "T·B = 6 rows"), {"N": 2, "p": 3 + bias, "bias": bias}))
    return cases
