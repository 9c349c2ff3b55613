"""End-to-end network capabilities: exact curvature matrices and block-diagonal K-FAC of small
networks (MLP, deep linear, CNN, weight-shared dense), including the exactness cases.

A network is described portably in ``params["net"]``, a list of layers:

* ``{"kind": "dense", "d_in": 3, "d_out": 4, "bias": true}`` — ``s = x W + b``, W [d_in, d_out]
  (on [N, d] or weight-shared [N, S, d] inputs);
* ``{"kind": "conv2d", "c_in", "c_out", "kernel": [kh, kw], "stride", "padding", "dilation",
  "bias"}`` — NHWC, HWIO kernel;
* ``{"kind": "activation", "fn": "tanh"}``, ``{"kind": "mean_pool"}`` (mean over the
  positions/locations), ``{"kind": "flatten"}``;

and the loss in ``params["loss"]`` (``"categorical"`` with integer targets, or
``"normal_mean"`` with ``params["variance"]``).  Inputs: ``x``, ``targets`` and for every
parametric layer ``i`` (0-based position in the list) ``w{i}`` and ``b{i}``.  The objective
is the **mean** loss (1/N)Σℓ_n.  Matrices are [P, P] over all parameters in the canonical
order: layers in forward order, each layer's ``[W; b]`` flattened row-major (bias last).

Tolerance derivation: Jacobian products and factor GEMMs over N examples and D outputs:
work = N·D + P (the longest reductions), κ = 1 (no inverses), ×4 for the depth of the chain.
"""

from __future__ import annotations

import numpy as np

from ..conventions import vec_index
from ..model import SAFETY, Capability, Case, Tolerance, rng_for
from ._data import block_diag, to_np

REQUIRES = ("kfac_ref.nn", "kfac_ref.curvature", "kfac_ref.losses")


# -- network spec -> kfac_ref objects ---------------------------------------------------------
def build_net(spec):
    from kfac_ref import nn

    layers = []
    for i, s in enumerate(spec):
        k = s["kind"]
        if k == "dense":
            layer = nn.Dense(s["d_in"], s["d_out"], use_bias=s["bias"])
        elif k == "conv2d":
            pad = s["padding"]
            layer = nn.Conv2D(s["c_in"], s["c_out"], tuple(s["kernel"]), stride=s["stride"],
                              padding=pad if isinstance(pad, str) else tuple(map(tuple, pad)),
                              dilation=s["dilation"], use_bias=s["bias"])
        elif k == "activation":
            layer = nn.Activation(s["fn"])
        elif k == "mean_pool":
            layer = nn.MeanPool()
        elif k == "flatten":
            layer = nn.Flatten()
        else:
            raise ValueError(f"unknown layer kind {k!r}")
        layers.append((f"{k}{i}", layer))
    return nn.Sequential(layers)


def params_from_inputs(spec, inputs, to_backend=lambda v: v):
    out = []
    for i, s in enumerate(spec):
        if s["kind"] in ("dense", "conv2d"):
            p = (to_backend(inputs[f"w{i}"]),)
            if s["bias"]:
                p = p + (to_backend(inputs[f"b{i}"]),)
            out.append(p)
        else:
            out.append(())
    return tuple(out)


def loss_fn(params):
    from kfac_ref import losses as L

    if params["loss"] == "categorical":
        return L.CategoricalLogitsNegativeLogProbLoss
    v = params["variance"]
    return lambda out, y: L.NormalMeanNegativeLogProbLoss(out, y, variance=v)


def one_update(params, inputs, to_backend, mode=None, sharing=None, seed=0,
               layer_to_block=None):
    """kfac_ref's estimator of the case's network and its state after one update on the
    case's batch (in ``mode``, default ``params["mode"]``; the sampling modes draw from
    ``numpy.random.default_rng(seed)``): ``(estimator, state)``."""
    from kfac_ref.curvature import BlockDiagonalCurvature

    spec = params["net"]
    net = build_net(spec)
    theta = params_from_inputs(spec, inputs, to_backend)
    batch = (to_backend(inputs["x"]), to_backend(inputs["targets"]))
    est = BlockDiagonalCurvature(net, loss_fn(params), layer_to_block=layer_to_block,
                                 weight_sharing=sharing or params.get("weight_sharing", "expand"))
    rng = np.random.default_rng(seed)
    st = est.init(rng, (theta, batch))
    st = est.update_curvature_matrix_estimate(st, 0.0, 1.0, int(inputs["x"].shape[0]), rng,
                                              (theta, batch), mode or params["mode"])
    return est, st


def kfac_matrix(params, inputs, to_backend=lambda v: v, to_numpy=to_np, mode=None,
                sharing=None):
    """Block-diagonal K-FAC of the case's network (dense [P, P]) with kfac_ref."""
    est, st = one_update(params, inputs, to_backend, mode, sharing)
    return to_numpy(est.to_dense_matrix(st))


def kfac_inverse_matvec(params, inputs, to_backend=lambda v: v, to_numpy=to_np,
                        exact=None, damping=None):
    """(K + λI)⁻¹ v with the block-diagonal K-FAC K of one estimator update (kfac_ref):
    per block factored π damping of λ/s (``exact=False``) or exact damping."""
    est, st = one_update(params, inputs, to_backend)
    out = est.multiply_matpower(st, to_backend(inputs["v"]),
                                params["damping"] if damping is None else damping, -1.0,
                                params["exact"] if exact is None else exact, False)
    return to_numpy(out)


def layer_factors(params, inputs, to_backend=lambda v: v, to_numpy=to_np, mode=None,
                  sharing=None):
    """Every parametric layer's (A, G) after one update of kfac_ref's estimator."""
    _, st = one_update(params, inputs, to_backend, mode, sharing)
    return [(to_numpy(bs.factors[0].value), to_numpy(bs.factors[1].value))
            for bs in st.blocks_states]


def kfac_factors(params, inputs, which, to_backend=lambda v: v, to_numpy=to_np, mode=None,
                 sharing=None):
    """Block-diagonal matrix of every layer's input factors A (``which="input"``) or output
    factors G (``"output"``) after one update of kfac_ref's estimator."""
    k = 0 if which == "input" else 1
    return block_diag([f[k] for f in layer_factors(params, inputs, to_backend, to_numpy,
                                                       mode, sharing)])


def _hybrid_input_factor(a_kfc, t, has_bias):
    """BackPACK's conv input factor: Σ_{n,t} p pᵀ / N = |T|·A_KFC on the weight coordinates.
    The bias is not a homogeneous coordinate there: its block is the reduce one, G_reduce
    (the bias gradient Σ_t g_t), i.e. a unit bias entry without cross terms."""
    out = t * a_kfc
    if has_bias:
        out[-1, :] = 0.0
        out[:, -1] = 0.0
        out[-1, -1] = 1.0
    return out


def conv_style_alternatives(params, inputs, t_conv):
    """kfac_ref's K-FAC of a conv net with its conv layers in KFAC-reduce and in BackPACK's
    hybrid style (A = |T|·A_KFC, G = G_reduce), other layers unchanged: the block-diagonal
    matrix and the input and output factors (the hybrid output factors are the reduce ones)."""
    from kfac_ref.linalg import kron

    spec = params["net"]
    expand = layer_factors(params, inputs, sharing="expand")
    reduce = layer_factors(params, inputs, sharing="reduce")
    layers = _factor_layers(spec)
    k_reduce = kfac_matrix(params, inputs, sharing="reduce")
    k_hybrid = kfac_matrix(params, inputs, sharing="expand")
    a_hybrid = []
    for s, (off, p, q, b, _), (a_e, _), (_, g_r) in zip(
            layers, _layer_geometry(spec), expand, reduce, strict=True):
        if s["kind"] != "conv2d":
            a_hybrid.append(a_e)
            continue
        a_h = _hybrid_input_factor(a_e, t_conv, b)
        a_hybrid.append(a_h)
        sl = slice(off, off + p * q)
        k_hybrid[sl, sl] = to_np(kron(a_h, g_r))
    return {
        "kfac": {"_conv_reduce": k_reduce, "_conv_hybrid": k_hybrid},
        "input": {"_conv_reduce": block_diag([a for a, _ in reduce]),
                  "_conv_hybrid": block_diag(a_hybrid)},
        "output": {"_conv_reduce": block_diag([g for _, g in reduce])},
    }


def ef_per_loss_term(params, inputs):
    """curvlinops' empirical Fisher of a per-position loss on a position-wise network:
    (1/N)Σ_{n,s} ∇ℓ_{ns}∇ℓ_{ns}ᵀ = S · EF of the N·S positions taken as examples."""
    x, y = inputs["x"], inputs["targets"]
    n, s_ = x.shape[:2]
    flat = dict(inputs, x=x.reshape(n * s_, *x.shape[2:]), targets=y.reshape(n * s_, -1))
    return s_ * exact_matrix(params, flat, "ef")


def exact_matrix(params, inputs, kind, to_backend=lambda v: v, to_numpy=to_np):
    from kfac_ref import curvature as C

    spec = params["net"]
    net = build_net(spec)
    theta = params_from_inputs(spec, inputs, to_backend)
    batch = (to_backend(inputs["x"]), to_backend(inputs["targets"]))
    if kind == "ggn":
        return to_numpy(C.ggn_matrix(net, loss_fn(params), theta, batch))
    return to_numpy(C.empirical_fisher_matrix(net, loss_fn(params), theta, batch))


# -- conversions -----------------------------------------------------------------------------
def _layer_geometry(spec):
    """(offset, p, q, has_bias, patch) of every parametric layer."""
    out, off = [], 0
    for s in spec:
        if s["kind"] == "dense":
            p, q, patch = s["d_in"] + s["bias"], s["d_out"], None
        elif s["kind"] == "conv2d":
            k = s["kernel"]
            p, q = k[0] * k[1] * s["c_in"] + s["bias"], s["c_out"]
            patch = (tuple(k), s["c_in"])
        else:
            continue
        out.append((off, p, q, bool(s["bias"]), patch))
        off += p * q
    return out


def _param_index(spec, conv):
    return np.concatenate([off + vec_index(p, q, conv, b, patch)
                           for off, p, q, b, patch in _layer_geometry(spec)])


def _scale(case, conv, empirical=False):
    """Scalar from the reference's normalisation into the declared one: N for the sum loss,
    and for a normal-mean loss declared with a fixed variance v the ratio v_case / v, linear
    for curvatures (the output-space Hessian is I/v) and **squared** for empirical-Fisher
    quantities (``empirical=True``: outer products of gradients, and the gradient at the data
    targets scales by v_case / v)."""
    s = float(case.meta["N"]) if conv.curvature_of == "sum" else 1.0
    if case.params["loss"] == "normal_mean" and conv.mse_variance is not None:
        s *= (case.params["variance"] / conv.mse_variance) ** (2 if empirical else 1)
    return s


def _is_empirical(case):
    return case.params.get("mode") == "fisher_empirical"


def _matrix(arr, case, conv, empirical=False):
    idx = _param_index(case.params["net"], conv)
    return arr[np.ix_(idx, idx)] * _scale(case, conv, empirical)


def _ef_matrix(arr, case, conv):
    if conv.empirical_fisher_unit == "loss_term" and "_ef_loss_term" in case.alternatives:
        arr = _substitute(arr, case, "_ef_loss_term", "empirical_fisher_unit='loss_term'")
    out = _matrix(arr, case, conv, empirical=True)
    return out / case.meta["N"] if conv.empirical_fisher_scale == "kfac_jax" else out


def _has_conv(case):
    return any(s["kind"] == "conv2d" for s in case.params["net"])


def _substitute(arr, case, key, what):
    """The stored reference alternative ``key`` (kfac_ref's output under another
    approximation) in place of the expected value.  Only the expected value itself has one:
    an alternative (a pitfall's output) is not convertible into that approximation."""
    if arr is not case.expected:
        raise NotImplementedError(f"{what} is only available for the expected value")
    if key not in case.alternatives:
        raise NotImplementedError(f"{what}: the case has no reference alternative {key!r}")
    return case.alternatives[key]


def _conv_styled(arr, case, conv, hybrid_key="_conv_hybrid"):
    """KFAC-reduce / hybrid conv blocks (stored reference alternatives) for conv nets."""
    if conv.conv_style in ("reduce", "hybrid") and _has_conv(case):
        key = "_conv_reduce" if conv.conv_style == "reduce" else hybrid_key
        return _substitute(arr, case, key, f"conv_style={conv.conv_style!r}")
    return arr


def _kfac_matrix(arr, case, conv):
    arr = _conv_styled(arr, case, conv)
    if conv.bias_position == "separate":
        # a separate bias block drops the weight-bias cross terms of every layer's block
        arr = arr.copy()
        for off, p, q, b, _ in _layer_geometry(case.params["net"]):
            if b:
                w = slice(off, off + (p - 1) * q)
                bb = slice(off + (p - 1) * q, off + p * q)
                arr[w, bb] = 0.0
                arr[bb, w] = 0.0
    out = _matrix(arr, case, conv, _is_empirical(case))
    if _is_empirical(case) and conv.empirical_fisher_scale == "kfac_jax":
        out = out / case.meta["N"]
    return out


def _factor_layers(spec):
    """(offset, size, spec) of every parametric layer's factor in the block-diagonal
    factor matrix (the caller picks A or G sizes)."""
    return [s for s in spec if s["kind"] in ("dense", "conv2d")]


def _input_factors(arr, case, conv):
    arr = _conv_styled(arr, case, conv)
    from ..conventions import a_index

    idx, off = [], 0
    for _, p, _, b, patch in _layer_geometry(case.params["net"]):
        idx.append(off + a_index(p, conv.bias_position, b, patch, conv.patch_order))
        off += p
    idx = np.concatenate(idx)
    return arr[np.ix_(idx, idx)]


def _output_factors(arr, case, conv):
    arr = _conv_styled(arr, case, conv, hybrid_key="_conv_reduce")
    out = arr * _scale(case, conv, _is_empirical(case))
    if _is_empirical(case) and conv.empirical_fisher_scale == "kfac_jax":
        out = out / case.meta["N"]
    if conv.conv_style == "expand":
        # curvlinops 'expand': G summed (not averaged) over the |T| locations / S positions of
        # each weight-sharing layer (meta layer_T; 1 for layers without sharing)
        scales = []
        for t, (_, _, q, _, _) in zip(case.meta["layer_T"],
                                      _layer_geometry(case.params["net"]), strict=True):
            scales += [t] * q
        sc = np.asarray(scales, dtype=np.float64)
        out = out * np.sqrt(sc)[:, None] * np.sqrt(sc)[None, :]
    return out


def _inverse_inputs(inputs, case, conv):
    out = dict(inputs)
    out["v"] = inputs["v"][_param_index(case.params["net"], conv)]
    return out


def _inverse_output(arr, case, conv):
    scale = _scale(case, conv)
    if scale != 1.0 or conv.bias_position == "separate":
        # (cK + λI)⁻¹ is not a rescaling of (K + λI)⁻¹, and a separate bias block is another
        # approximation: the suite has no conversion for these declarations
        raise NotImplementedError(
            "networks.kfac_inverse_matvec is only converted for permutation conventions "
            "(kron_order, bias_position first/last, patch_order); declare curvature_of='mean', "
            "the case's variance and a joint bias, or compare networks.kfac")
    return arr[_param_index(case.params["net"], conv)]


_SIG = ("inputs: x, targets, w{i}, b{i}; params: net (layer list), loss, variance, "
        "mode, weight_sharing")
_CONV = ("kron_order", "bias_position", "patch_order", "curvature_of", "mse_variance")

CAPABILITIES = [
    Capability("networks.ggn",
               "Exact generalised Gauss-Newton matrix of the mean loss over all parameters, "
               "[P, P] (parameter order per declared conventions).", _SIG, _CONV,
               convert_output=_matrix),
    Capability("networks.empirical_fisher",
               "Empirical Fisher (1/N)Σ_n ∇ℓ_n ∇ℓ_nᵀ at the data targets, [P, P].", _SIG,
               _CONV + ("empirical_fisher_scale", "empirical_fisher_unit"),
               convert_output=_ef_matrix),
    Capability("networks.kfac_input_factors",
               "Every layer's K-FAC input factor A (dense: (1/N)Σ āāᵀ; conv: KFC Ω over N·|T| "
               "patch rows) after one estimator update, as one block-diagonal matrix in layer "
               "order.", _SIG, ("bias_position", "patch_order", "conv_style"),
               convert_output=_input_factors),
    Capability("networks.kfac_output_factors",
               "Every layer's K-FAC output factor G ((1/N)Σ g gᵀ of the mode's back-propagated "
               "vectors; conv: over N·|T| rows) after one estimator update, block-diagonal in "
               "layer order.", _SIG,
               ("curvature_of", "mse_variance", "empirical_fisher_scale", "conv_style"),
               convert_output=_output_factors),
    Capability("networks.kfac_inverse_matvec",
               "(K + λI)⁻¹ v for the block-diagonal K-FAC K of params['mode'] (one update): "
               "per layer factored Tikhonov damping with the trace-norm π split of λ/s "
               "(s = |T| for conv blocks; params['exact'] = False) or exact damping "
               "(A⊗G + λI)⁻¹ through both eigenbases (exact = True); [P].",
               _SIG + ", damping, exact; inputs: v [P]",
               ("kron_order", "bias_position", "patch_order", "curvature_of", "mse_variance"),
               convert_inputs=_inverse_inputs, convert_output=_inverse_output),
    Capability("networks.kfac",
               "Block-diagonal K-FAC matrix (one Kronecker block per layer, dense [P, P]) "
               "estimated with params['mode'] ('ggn_exact' = type-2/exact GGN, "
               "'fisher_exact' = exact Fisher (equal for these natural-parameter losses), "
               "'fisher_empirical' = empirical) in one batch; conv layers KFC (|T|·A⊗G), "
               "weight-shared dense layers KFAC-expand or -reduce as "
               "params['weight_sharing'] says.", _SIG,
               _CONV + ("empirical_fisher_scale", "conv_style"), convert_output=_kfac_matrix),
]


# -- cases -------------------------------------------------------------------------------------
def _dense(d_in, d_out, bias=True):
    return {"kind": "dense", "d_in": d_in, "d_out": d_out, "bias": bias}


def _tanh():
    return {"kind": "activation", "fn": "tanh"}


def _small_conv():
    """A 2×2 VALID convolution from 2 to 2 channels, with a bias."""
    return {"kind": "conv2d", "c_in": 2, "c_out": 2, "kernel": [2, 2], "stride": 1,
            "padding": "VALID", "dilation": 1, "bias": True}


def draw_parameters(r, spec):
    """Every parametric layer's ``w{i}`` (scaled by 1/√fan-in) and ``b{i}`` (scaled by 0.3),
    drawn from ``r`` in layer order."""
    out = {}
    for i, s in enumerate(spec):
        if s["kind"] == "dense":
            out[f"w{i}"] = r.standard_normal((s["d_in"], s["d_out"])) / np.sqrt(s["d_in"])
            if s["bias"]:
                out[f"b{i}"] = 0.3 * r.standard_normal(s["d_out"])
        elif s["kind"] == "conv2d":
            kh, kw = s["kernel"]
            out[f"w{i}"] = r.standard_normal((kh, kw, s["c_in"], s["c_out"])) / np.sqrt(
                kh * kw * s["c_in"])
            if s["bias"]:
                out[f"b{i}"] = 0.3 * r.standard_normal(s["c_out"])
    return out


def _make_inputs(cid, spec, x_shape, loss, n_out):
    r = rng_for(cid)
    inputs = {"x": r.standard_normal(x_shape)}
    inputs.update(draw_parameters(r, spec))
    n = x_shape[0]
    if loss == "categorical":
        inputs["targets"] = r.integers(0, n_out, size=n).astype(np.int64)
    else:
        out_shape = (n,) + tuple(n_out) if isinstance(n_out, tuple) else (n, n_out)
        inputs["targets"] = r.standard_normal(out_shape)
    return inputs


def _block_diagonal(mat, spec):
    out = np.zeros_like(mat)
    for off, p, q, _, _ in _layer_geometry(spec):
        sl = slice(off, off + p * q)
        out[sl, sl] = mat[sl, sl]
    return out


def build_cases() -> list[Case]:
    conv, tanh = _small_conv(), _tanh()
    # (name, spec, x shape, loss params, output size, exact?, description)
    nets = [
        ("mlp_tanh_n1_ce", [_dense(3, 4), tanh, _dense(4, 3)], (1, 3),
         {"loss": "categorical"}, 3, True,
         "N = 1: K-FAC type-2 equals the GGN blocks for any network"),
        ("mlp_tanh_n4_ce", [_dense(3, 4), tanh, _dense(4, 3)], (4, 3),
         {"loss": "categorical"}, 3, False, "N = 4 with cross-entropy: K-FAC is approximate"),
        ("deep_linear_n5_mse", [_dense(3, 3), _dense(3, 2)], (5, 3),
         {"loss": "normal_mean", "variance": 0.5}, 2, True,
         "deep linear network + squared error: K-FAC type-2 equals the GGN blocks for any N"),
        ("cnn_pool_n3_mse", [conv, tanh, {"kind": "mean_pool"}, _dense(2, 2)], (3, 5, 4, 2),
         {"loss": "normal_mean", "variance": 1.0}, 2, False,
         "conv → tanh → mean pool → dense: KFC (|T| = 12) for the conv block"),
        # S = 5 positions: |T| must differ from N = 3, from 2 and from 4 = 2² (a squared-error
        # factor 2 scales an empirical Fisher by 4)
        ("shared_linear_expand_n3_mse", [_dense(3, 2)], (3, 5, 3),
         {"loss": "normal_mean", "variance": 0.5}, (5, 2), True,
         "weight-shared dense layer, loss per position: KFAC-expand is exact"),
        ("shared_linear_pool_reduce_n3_mse", [_dense(3, 2), {"kind": "mean_pool"}], (3, 5, 3),
         {"loss": "normal_mean", "variance": 0.5}, 2, True,
         "weight-shared dense layer pooled before the loss: KFAC-reduce is exact"),
    ]
    cases = []
    for name, spec, x_shape, lossp, n_out, exact, desc in nets:
        sharing = "reduce" if "reduce" in name else "expand"
        base = {"net": spec, **lossp}
        inputs = _make_inputs(f"networks/{name}", spec, x_shape, lossp["loss"], n_out)
        n = x_shape[0]
        p_total = sum(p * q for _, p, q, _, _ in _layer_geometry(spec))
        d_out = int(np.prod(n_out)) if isinstance(n_out, tuple) else n_out
        t_conv = 12 if "cnn" in name else (x_shape[1] if len(x_shape) == 3 else None)
        meta = {"N": n, **({"T": t_conv} if t_conv else {})}
        work = n * d_out + p_total
        tol = Tolerance(SAFETY * 4 * work, f"Jacobian products and factor GEMMs: work = N·D + "
                                           f"P = {work}, κ = 1, ×4 for the chain depth")
        ggn = exact_matrix(base, inputs, "ggn")
        ef = exact_matrix(base, inputs, "ef")
        cases.append(Case(f"networks.ggn/{name}", "networks.ggn", inputs, base, ggn, tol,
                          dict(meta), description=desc))
        ef_alts = {"true_fisher": ggn} if lossp["loss"] == "categorical" else {}
        if isinstance(n_out, tuple) and len(spec) == 1:  # a loss term per position
            ef_alts["_ef_loss_term"] = ef_per_loss_term(base, inputs)
        cases.append(Case(f"networks.empirical_fisher/{name}", "networks.empirical_fisher",
                          inputs, base, ef, tol, dict(meta), ef_alts, description=desc))
        modes = ("ggn_exact", "fisher_empirical") + (
            ("fisher_exact",) if name in ("mlp_tanh_n4_ce", "deep_linear_n5_mse") else ())
        for mode in modes:
            params = dict(base, mode=mode, weight_sharing=sharing)
            k = kfac_matrix(params, inputs)
            styled = conv_style_alternatives(params, inputs, t_conv) if any(
                s_["kind"] == "conv2d" for s_ in spec) else {"kfac": {}, "input": {},
                                                             "output": {}}
            true_mode = mode != "fisher_empirical"
            other = kfac_matrix(params, inputs, mode="fisher_empirical" if true_mode
                                else "ggn_exact")
            alts = {"empirical_fisher" if true_mode else "true_fisher": other,
                    "exact_block_diagonal": _block_diagonal(ggn if true_mode else ef, spec)}
            if len(x_shape) == 3:  # weight sharing: the other approximation
                other_sharing = "reduce" if sharing == "expand" else "expand"
                alts[f"{other_sharing}_instead_of_{sharing}"] = kfac_matrix(
                    params, inputs, sharing=other_sharing)
            alts.update(styled["kfac"])
            # exactness (docs pages *K-FAC for dense layers*, "When it is exact", and
            # *Convolutions*, "KFAC-expand and KFAC-reduce"): K-FAC equals the block diagonal of the
            # exact curvature; build_catalogue's finalize() then lists exact_block_diagonal
            # in insensitive_to, which tests/conformance/test_conformance.py checks.
            m = dict(meta, exact=bool(exact and true_mode) or (
                n == 1 and mode == "fisher_empirical"))
            cases.append(Case(f"networks.kfac/{name}_{mode}", "networks.kfac", inputs, params,
                              k, tol, m, alts, desc))
            if mode == "ggn_exact" and name in ("mlp_tanh_n4_ce", "cnn_pool_n3_mse"):
                v = rng_for(f"networks/{name}/v").standard_normal(p_total)
                for exact_d in (False, True):
                    pinv = dict(params, damping=0.1, exact=exact_d)
                    inv_in = dict(inputs, v=v)
                    ref = kfac_inverse_matvec(pinv, inv_in)
                    alts = {("factored_damping" if exact_d else "exact_damping"):
                            kfac_inverse_matvec(pinv, inv_in, exact=not exact_d)}
                    kinv = np.linalg.cond(k + 0.1 * np.eye(p_total))
                    cases.append(Case(
                        f"networks.kfac_inverse_matvec/{name}_{'exact' if exact_d else 'factored'}",
                        "networks.kfac_inverse_matvec", inv_in, pinv, ref,
                        Tolerance(SAFETY * 4 * work * kinv,
                                  f"{tol.derivation}, × κ(K + λI) = {kinv:.3g}"),
                        dict(meta), alts, desc))
            if mode == "fisher_exact" or (mode == "ggn_exact" and "reduce" in name):
                continue
            other_mode = "ggn_exact" if mode == "fisher_empirical" else "fisher_empirical"
            layer_t = []  # weight-sharing multiplicity of each parametric layer
            for s_ in _factor_layers(spec):
                if s_["kind"] == "conv2d":
                    layer_t.append(t_conv)
                else:
                    layer_t.append(x_shape[1] if len(x_shape) == 3 and sharing == "expand"
                                   and s_ is spec[0] else 1)
            fmeta = dict(meta, layer_T=layer_t)
            cases.append(Case(f"networks.kfac_input_factors/{name}_{mode}",
                              "networks.kfac_input_factors", inputs, params,
                              kfac_factors(params, inputs, "input"), tol, dict(fmeta),
                              dict(styled["input"]), description=desc))
            cases.append(Case(f"networks.kfac_output_factors/{name}_{mode}",
                              "networks.kfac_output_factors", inputs, params,
                              kfac_factors(params, inputs, "output"), tol, dict(fmeta),
                              {"empirical_fisher" if true_mode else "true_fisher":
                               kfac_factors(params, inputs, "output", mode=other_mode),
                               **styled["output"]},
                              description=desc))
    return cases
