"""kfac-jax-named curvature blocks: products against dense powers, spectra, cache, statistics."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_allclose_normwise

from kfac_ref import KFACTypeError, KFACValueError
from kfac_ref.blocks import kfac_jax as kj

POWERS = [-1.0, -0.5, 0.5, 1.0, 2.0]
N = 24



# A cotangent off the output grid: wrong spatial size, or wrong C_out.
_WRONG_OUTPUT_GRID = (r"outputs_grad (must be an array of shape|must have the convolution.s "
                      r"output grid|and kernel_shape must agree on out_channels)")

def _conv_in(rng, n, h, w, c):
    return rng.standard_normal((n, h, w, c))


def build(name, xp, rng):
    """(block, estimation_data (host), batch size, full_rank)."""
    a3 = rng.standard_normal((N, 3))
    g2 = rng.standard_normal((N, 2))
    dense = {"inputs": a3, "outputs_grad": g2}
    conv_kw = dict(inputs_shape=(N, 3, 3, 1), kernel_shape=(2, 2, 1, 2), strides=1,
                   padding="VALID")
    conv = {"inputs": _conv_in(rng, N, 3, 3, 1), "outputs_grad": rng.standard_normal((N, 2, 2, 2))}
    sas = {"inputs": rng.standard_normal((N, 3, 2)), "outputs_grad": rng.standard_normal((N, 3, 2))}
    naive = {"params_grads": (rng.standard_normal((3, 3, 2)), rng.standard_normal((3, 2)))}
    table = {
        "ScaledIdentity": (lambda: kj.ScaledIdentity([(3, 2), (2,)], scale=1.7), None, True),
        "NaiveDiagonal": (lambda: kj.NaiveDiagonal([(3, 2), (2,)]), naive, True),
        "NaiveFull": (lambda: kj.NaiveFull([(3, 2), (2,)]), naive, False),
        "DenseDiagonal": (lambda: kj.DenseDiagonal(3, 2), dense, True),
        "DenseFull": (lambda: kj.DenseFull(3, 2), dense, True),
        "DenseTwoKroneckerFactored": (lambda: kj.DenseTwoKroneckerFactored(3, 2), dense, True),
        "Conv2DDiagonal": (lambda: kj.Conv2DDiagonal(**conv_kw), conv, True),
        "Conv2DFull": (lambda: kj.Conv2DFull(**conv_kw), conv, True),
        "Conv2DTwoKroneckerFactored": (lambda: kj.Conv2DTwoKroneckerFactored(**conv_kw), conv,
                                       True),
        "ScaleAndShiftDiagonal": (lambda: kj.ScaleAndShiftDiagonal((3, 2), (2,), (1, 2)), sas,
                                  True),
        "ScaleAndShiftFull": (lambda: kj.ScaleAndShiftFull((3, 2), (2,), (2,)), sas, True),
        # per-example gradients as N sources (three sources are too few for a well
        # conditioned TNT block)
        "NaiveTNT": (lambda: kj.NaiveTNT([(3, 2), (2,)]),
                     {"params_grads": (np.einsum("ni,nj->nij", a3, g2), g2)}, True),
        "DenseTNT": (lambda: kj.DenseTNT(3, 2), dense, True),
        "Conv2DTNT": (lambda: kj.Conv2DTNT(**conv_kw), conv, True),
        "DenseFOOF": (lambda: kj.DenseFOOF(3, 2), dense, True),
        "DenseKPSVD": (lambda: kj.DenseKPSVD(3, 2), dense, True),
    }
    ctor, data, full_rank = table[name]
    return ctor(), data, full_rank


BLOCKS = ["ScaledIdentity", "NaiveDiagonal", "NaiveFull", "DenseDiagonal", "DenseFull",
          "DenseTwoKroneckerFactored", "Conv2DDiagonal", "Conv2DFull",
          "Conv2DTwoKroneckerFactored", "ScaleAndShiftDiagonal", "ScaleAndShiftFull",
          "NaiveTNT", "DenseTNT", "Conv2DTNT", "DenseFOOF", "DenseKPSVD"]
KRON = {"DenseTwoKroneckerFactored", "Conv2DTwoKroneckerFactored", "NaiveTNT", "DenseTNT",
        "Conv2DTNT", "DenseFOOF", "DenseKPSVD"}


def to_xp(xp, data):
    if data is None:
        return {}
    out = {}
    for k, v in data.items():
        out[k] = tuple(xp.asarray(a) for a in v) if isinstance(v, tuple) else xp.asarray(v)
    return out


def make_state(xp, rng, name, **init_kw):
    block, data, full_rank = build(name, xp, rng)
    state = block.init(xp.asarray(np.zeros(1)), **init_kw)
    state = block.update_curvature_matrix_estimate(state, to_xp(xp, data), 0.0, 1.0, N)
    return block, state, data, full_rank


def random_vector(xp, rng, block):
    host = [rng.standard_normal(s) for s in block.parameters_shapes]
    return tuple(xp.asarray(h) for h in host), np.concatenate(
        [xp.round_host(h).reshape(-1) for h in host])


def dense_power(m, p):
    s, q = np.linalg.eigh((m + m.T) / 2)
    return (q * np.clip(s, 0, None) ** p) @ q.T


def flat(xp, vec):
    return np.concatenate([xp.to_numpy(v).reshape(-1) for v in vec])


def approx_dense(xp, block, state, lam):
    """Oracle for the π-damped Kronecker block, from the state's factors (trace-norm π)."""
    a, g = (xp.to_numpy(f.value) for f in state.statistics)
    s = block.scale(state)  # a 0-D array for blocks whose scale depends on the state (TNT)
    s = s if isinstance(s, float) else float(xp.to_numpy(s))
    ta, tg = np.trace(a) / a.shape[0], np.trace(g) / g.shape[0]
    pi = np.sqrt(ta / tg)
    r = np.sqrt(lam / s)
    return s * np.kron(a + pi * r * np.eye(a.shape[0]), g + r / pi * np.eye(g.shape[0]))


# Tolerance: statistics from N = 24 Gaussian rows have condition numbers below ~1e2 (checked
# by the eigenvalue assertion below); dense size <= 10; the fixture's 4096·eps bound covers
# n·κ up to 4096 (float32 cells included: they pass at the plain budget).
@pytest.mark.parametrize("name", BLOCKS)
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("damping", [0.0, 0.3])
def test_multiply_matpower_vs_dense(xp, rng, name, exact, damping):
    block, state, _, full_rank = make_state(xp, rng, name)
    dense = xp.to_numpy(block.to_dense_matrix(state))
    assert dense.shape == (block.dim, block.dim)
    evals = np.linalg.eigvalsh(dense)
    if full_rank and "Diagonal" not in name:  # diagonal products are elementwise
        assert evals.min() > 1e-2 * evals.max(), "test data must be well conditioned"
    for power in POWERS:
        vec, vh = random_vector(xp, rng, block)

        def call(vec=vec, power=power):
            return block.multiply_matpower(state, vec, damping, power, exact, False)

        if name in KRON and not exact and power == 2.0:
            with pytest.raises(KFACValueError, match="approximate"):
                call()
            continue
        if power < 0 and damping == 0.0 and not full_rank:
            with pytest.raises(KFACValueError, match="positive definite"):
                call()
            continue
        out = call()
        assert len(out) == block.number_of_parameters
        for o, shape in zip(out, block.parameters_shapes, strict=True):
            xp.check(o)
            assert tuple(o.shape) == shape
        if name in KRON and not exact:
            m = approx_dense(xp, block, state, damping)
        else:
            m = dense + damping * np.eye(block.dim)
        rtol = xp.rtol
        atol = 0.0
        if not full_rank and damping == 0.0 and power == 0.5:
            # Square root at zero eigenvalues: ‖(M+E)^½ − M^½‖ ≤ ‖E‖^½ with rounding
            # ‖E‖ ≲ n·eps·‖M‖, so allow 4·√(n·eps·‖M‖)·‖v‖.
            atol = 4 * np.sqrt(block.dim * xp.eps * np.abs(evals).max()) * np.linalg.norm(vh)
        assert_allclose_normwise(flat(xp, out), dense_power(m, power) @ vh, rtol, atol)


@pytest.mark.parametrize("name", BLOCKS)
def test_eigenvalues_and_norm(xp, rng, name):
    block, state, _, _ = make_state(xp, rng, name)
    dense = xp.to_numpy(block.to_dense_matrix(state))
    ev = block.eigenvalues(state, use_cached=False)
    xp.check(ev)
    assert_allclose_normwise(np.sort(xp.to_numpy(ev)), np.linalg.eigvalsh(dense), xp.rtol)
    assert float(block.norm(state, "avg_diag")) == pytest.approx(np.trace(dense) / block.dim,
                                                          rel=xp.rtol)
    assert float(block.norm(state, "2_norm")) == pytest.approx(np.linalg.eigvalsh(dense).max(),
                                                        rel=xp.rtol)
    with pytest.raises(KFACValueError, match="norm_type must be one of"):
        block.norm(state, "trace")
    if name == "ScaledIdentity":  # the dense oracle above is the block's own: pin it
        xp.assert_close(block.to_dense_matrix(state), 1.7 * np.eye(block.dim))


@pytest.mark.parametrize("name", BLOCKS)
@pytest.mark.parametrize("norm", [None, "avg_diag"])
def test_cached_equals_uncached(xp, rng, name, norm):
    approx = [-1.0, -0.5, 0.5] if name in KRON else [-1.0, 0.5]
    block, state, _, _ = make_state(xp, rng, name, exact_powers_to_cache=POWERS,
                                    approx_powers_to_cache=approx, cache_eigenvalues=True)
    w = 0.3
    state = block.update_cache(state, w, POWERS, approx, True,
                               norm_to_scale_identity_weight=norm)
    for exact, powers in ((True, POWERS), (False, approx + [1.0])):
        for power in powers:
            vec, _ = random_vector(xp, rng, block)
            fresh = block.multiply_matpower(state, vec, w, power, exact, False,
                                            norm_to_scale_identity_weight=norm)
            cached = block.multiply_matpower(state, vec, w, power, exact, True,
                                             norm_to_scale_identity_weight=norm)
            # Same arithmetic on the same snapshot: equal to rounding.
            assert_allclose_normwise(flat(xp, cached), flat(xp, fresh), 16 * xp.eps)
    xp.assert_close(block.eigenvalues(state, True), xp.to_numpy(block.eigenvalues(state, False)),
                    rtol=16 * xp.eps)


@pytest.mark.parametrize("name", [b for b in BLOCKS if b != "ScaledIdentity"])
def test_cache_is_a_snapshot_of_the_statistics(xp, rng, name):
    """The cached products read the statistics, scale and norm of the ``update_cache`` call,
    not the (newer) statistics of the state they are given: after one more estimate update,
    the cached product equals the fresh product of the *old* state and differs from the fresh
    product of the new one.  The norm-scaled exact power is included: there the cache must
    supply ‖sB‖ (the weight is applied at product time)."""
    block, data, _ = build(name, xp, rng)
    approx = [-1.0] if name in KRON else []
    old = block.init(xp.asarray(np.zeros(1)), exact_powers_to_cache=[-1.0],
                     approx_powers_to_cache=approx)
    old = block.update_curvature_matrix_estimate(old, to_xp(xp, data), 0.0, 1.0, N)
    _, data2, _ = build(name, xp, np.random.default_rng(12345))
    w, norm = 0.3, "avg_diag"
    old = block.update_cache(old, w, [-1.0], approx, False, norm_to_scale_identity_weight=norm)
    new = block.update_curvature_matrix_estimate(old, to_xp(xp, data2), 0.0, 1.0, N)
    cases = [(e, p) for e in ((True, False) if approx else (True,)) for p in (-1.0, 1.0)]
    for exact, power in cases:
        vec, _ = random_vector(xp, rng, block)

        def product(state, use_cached, vec=vec, exact=exact, power=power):
            return flat(xp, block.multiply_matpower(state, vec, w, power, exact, use_cached,
                                                    norm_to_scale_identity_weight=norm))

        cached, fresh_old, fresh_new = product(new, True), product(old, False), product(new, False)
        assert_allclose_normwise(cached, fresh_old, 16 * xp.eps)
        # Different statistics change the product by O(1) relative to itself (independent
        # Gaussian data), far above rounding.
        assert np.max(np.abs(cached - fresh_new)) > 1e-3 * np.max(np.abs(fresh_new))


def test_norm_scaled_identity_weight_reaches_the_cache(xp, rng):
    """The kfac-jax fault (block_diagonal.py):
    update_cache ignores the per-block norm scaling.  Here the
    cached inverse equals the uncached one built with λ = w·‖B‖ and differs from λ = w."""
    block, state, _, _ = make_state(xp, rng, "DenseTwoKroneckerFactored",
                                    approx_powers_to_cache=[-1.0])
    w = 0.5
    state = block.update_cache(state, w, None, [-1.0], False,
                               norm_to_scale_identity_weight="avg_diag")
    vec, _ = random_vector(xp, rng, block)
    nrm = block.norm(state, "avg_diag")
    cached = flat(xp, block.multiply_inverse(state, vec, w, False, True,
                                             norm_to_scale_identity_weight="avg_diag"))
    manual = flat(xp, block.multiply_inverse(state, vec, w * nrm, False, False))
    unscaled = flat(xp, block.multiply_inverse(state, vec, w, False, False))
    assert_allclose_normwise(cached, manual, 16 * xp.eps)
    assert np.max(np.abs(cached - unscaled)) > 1e-3 * np.max(np.abs(unscaled))
    # A different weight for the baked-in cached inverse is an error (strict), both weights
    # printed as numbers ...
    with pytest.raises(KFACValueError, match=r"identity_weight \(effective 0\.5\) must equal "
                                             r"the one the cached approximate power -1\.0 was "
                                             r"built with \([0-9.e+-]+\); call update_cache"):
        block.multiply_inverse(state, vec, w, False, True)
    # ... unless kfac-jax's behaviour is asked for.
    lax = kj.DenseTwoKroneckerFactored(3, 2, strict_cache=False)
    got = flat(xp, lax.multiply_inverse(state, vec, 123.0, False, True,
                                        norm_to_scale_identity_weight="avg_diag"))
    assert_allclose_normwise(got, cached, 16 * xp.eps)


def test_conv_kronecker_scale_bookkeeping(xp, rng):
    """Conv2DTwoKroneckerFactored: fixed_scale = |T|, dense = |T|·kron(Ω, Γ) with Ω, Γ from
    explicit loops over examples and locations, damping λ/|T| in the approximate inverse."""
    block = kj.Conv2DTwoKroneckerFactored((N, 4, 4, 2), (2, 2, 2, 3), strides=2, padding="SAME")
    assert block.num_locations == 4 and block.fixed_scale() == 4.0
    x = rng.standard_normal((N, 4, 4, 2))
    g = rng.standard_normal((N, 2, 2, 3))
    state = block.init(xp.asarray(np.zeros(1)))
    state = block.update_curvature_matrix_estimate(
        state, {"inputs": xp.asarray(x), "outputs_grad": xp.asarray(g)}, 0.0, 1.0, N)
    xh, gh = xp.round_host(x), xp.round_host(g)
    # SAME, stride 2, kernel 2 on 4: no padding needed (total 0); locations (0,0),(0,2),(2,0),(2,2)
    om = np.zeros((9, 9))
    ga = np.zeros((3, 3))
    for n in range(N):
        for i in range(2):
            for j in range(2):
                p = np.append(xh[n, 2 * i:2 * i + 2, 2 * j:2 * j + 2, :].reshape(-1), 1.0)
                om += np.outer(p, p)
                ga += np.outer(gh[n, i, j], gh[n, i, j])
    om /= 4 * N
    ga /= 4 * N
    xp.assert_close(block.to_dense_matrix(state), 4 * np.kron(om, ga))
    lam = 0.7
    vec, vh = random_vector(xp, rng, block)
    pi = np.sqrt((np.trace(om) / 9) / (np.trace(ga) / 3))
    r = np.sqrt(lam / 4)
    m = 4 * np.kron(om + pi * r * np.eye(9), ga + r / pi * np.eye(3))
    got = block.multiply_inverse(state, vec, lam, False, False)
    assert_allclose_normwise(flat(xp, got), np.linalg.solve(m, vh), xp.rtol)


def _per_example_conv_grads(x, g):
    """Loop oracle: DW_n = Σ_t p_{n,t} g_{n,t}ᵀ (VALID, stride 1, kernel 2×2), bias Σ_t g."""
    n_, h, w, c = x.shape
    out = []
    for n in range(n_):
        dw = np.zeros((2 * 2 * c + 1, g.shape[-1]))
        for i in range(h - 1):
            for j in range(w - 1):
                p = np.append(x[n, i:i + 2, j:j + 2, :].reshape(-1), 1.0)
                dw += np.outer(p, g[n, i, j])
        out.append(dw.reshape(-1))
    return np.array(out)


def test_full_statistics_vs_loops_and_diagonals(xp, rng):
    """Full blocks against per-example loops; diagonal blocks are their diagonals."""
    for full, diag in (("DenseFull", "DenseDiagonal"), ("Conv2DFull", "Conv2DDiagonal"),
                       ("ScaleAndShiftFull", "ScaleAndShiftDiagonal"),
                       ("NaiveFull", "NaiveDiagonal")):
        seed = rng.integers(1 << 30)
        bf, sf, data, _ = make_state(xp, np.random.default_rng(seed), full)
        bd, sd, _, _ = make_state(xp, np.random.default_rng(seed), diag)
        dense_f = xp.to_numpy(bf.to_dense_matrix(sf))
        # (the diagonal scale-and-shift block has a (1, 2) shift, the full one (2,): the
        # shift is summed over the size-3 axis either way, so the numbers agree)
        assert_allclose_normwise(np.diag(xp.to_numpy(bd.to_dense_matrix(sd))), np.diag(dense_f),
                                 xp.rtol)
        if full == "DenseFull":
            a = np.hstack([xp.round_host(data["inputs"]), np.ones((N, 1))])
            g = xp.round_host(data["outputs_grad"])
            t = np.array([np.outer(a[n], g[n]).reshape(-1) for n in range(N)])
            assert_allclose_normwise(dense_f, t.T @ t / N, xp.rtol)
        if full == "Conv2DFull":
            t = _per_example_conv_grads(xp.round_host(data["inputs"]),
                                        xp.round_host(data["outputs_grad"]))
            assert_allclose_normwise(dense_f, t.T @ t / N, xp.rtol)
        if full == "ScaleAndShiftFull":
            x, g = xp.round_host(data["inputs"]), xp.round_host(data["outputs_grad"])
            t = np.hstack([(x * g).sum(axis=1), g.sum(axis=1)])
            assert_allclose_normwise(dense_f, t.T @ t / N, xp.rtol)
        if full == "NaiveFull":
            # per-source square of the (batch-summed) gradient, summed over the 3 sources
            gs = np.hstack([xp.round_host(data["params_grads"][0]).reshape(3, -1),
                            xp.round_host(data["params_grads"][1])])
            assert_allclose_normwise(dense_f, gs.T @ gs / N, xp.rtol)


def test_naive_source_reduction_and_ema(xp, rng):
    g = (rng.standard_normal((2, 3)), rng.standard_normal((2, 2)))
    block = kj.NaiveDiagonal([(3,), (2,)], source_reduction="summed")
    st = block.init(xp.asarray(np.zeros(1)))
    st = block.update_curvature_matrix_estimate(
        st, {"params_grads": tuple(xp.asarray(v) for v in g)}, 0.0, 1.0, 5)
    summed = np.concatenate([xp.round_host(v).sum(0) for v in g])
    assert_allclose_normwise(np.diag(xp.to_numpy(block.to_dense_matrix(st))), summed**2 / 5,
                             xp.rtol)
    # kfac-jax's weighted EMA: (d·c1 + c2)/(d + 1) after two updates with ema_new = 1
    block = kj.DenseTwoKroneckerFactored(2, 2, has_bias=False)
    st = block.init(xp.asarray(np.zeros(1)))
    a1, a2 = rng.standard_normal((4, 2)), rng.standard_normal((4, 2))
    gg = rng.standard_normal((4, 2))
    for a in (a1, a2):
        st = block.update_curvature_matrix_estimate(
            st, {"inputs": xp.asarray(a), "outputs_grad": xp.asarray(gg)}, 0.5, 1.0, 4)
    c1, c2 = (xp.round_host(a).T @ xp.round_host(a) / 4 for a in (a1, a2))
    xp.assert_close(st.statistics[0].value, (0.5 * c1 + c2) / 1.5)


def test_bad_inputs(xp, rng):
    block, state, _, _ = make_state(xp, rng, "DenseTwoKroneckerFactored",
                                    approx_powers_to_cache=[-1.0])
    vec, _ = random_vector(xp, rng, block)
    with pytest.raises(KFACValueError, match="vector must have 2 arrays"):
        block.multiply(state, vec[:1], 0.1, True, False)
    with pytest.raises(KFACValueError, match=r"vector\[1\] must be an array of shape \(2\)"):
        block.multiply(state, (vec[0], xp.asarray(np.ones(3))), 0.1, True, False)
    with pytest.raises(KFACTypeError, match="vector must be a tuple"):
        block.multiply(state, vec[0], 0.1, True, False)
    with pytest.raises(KFACValueError, match="power must be one of"):
        block.multiply_matpower(state, vec, 0.1, 3.0, False, False)
    with pytest.raises(KFACValueError, match="norm_to_scale_identity_weight must be one of"):
        block.multiply(state, vec, 0.1, True, False, norm_to_scale_identity_weight="fro")
    with pytest.raises(KFACValueError, match="declared in init"):
        block.update_cache(state, 0.1, [-1.0], None, False)
    with pytest.raises(KFACValueError, match="power must be one of"):
        kj.DenseTwoKroneckerFactored(3, 2).init(xp.asarray(np.zeros(1)),
                                                approx_powers_to_cache=[2.0])
    with pytest.raises(KFACValueError, match="cache must hold"):
        block.multiply_inverse(state, vec, 0.1, True, True)
    with pytest.raises(KFACValueError, match="identity_weight must be non-negative"):
        block.multiply(state, vec, -0.1, True, False)
    with pytest.raises(KFACValueError, match="estimation_data must have the keys"):
        block.update_curvature_matrix_estimate(state, {"inputs": xp.asarray(np.ones((N, 3)))},
                                               0.0, 1.0, N)
    with pytest.raises(KFACValueError, match="batch_size = 5"):
        block.update_curvature_matrix_estimate(
            state, {"inputs": xp.asarray(np.ones((N, 3))),
                    "outputs_grad": xp.asarray(np.ones((N, 2)))}, 0.0, 1.0, 5)
    with pytest.raises(KFACValueError, match=r"inputs must be an array of shape"):
        block.update_curvature_matrix_estimate(
            state, {"inputs": xp.asarray(np.ones((N, 4))),
                    "outputs_grad": xp.asarray(np.ones((N, 2)))}, 0.0, 1.0, N)
    # conv blocks: outputs_grad must be on the layer's output grid with C_out channels
    # (2×2×2 here); another grid would normalise the statistics by a wrong |T|
    for conv in ("Conv2DDiagonal", "Conv2DFull", "Conv2DTwoKroneckerFactored"):
        cb, cdata, _ = build(conv, xp, rng)
        cst = cb.init(xp.asarray(np.zeros(1)))
        for bad in ((N, 3, 3, 2), (N, 2, 2, 3), (N, 1, 4, 2)):
            with pytest.raises(KFACValueError, match=_WRONG_OUTPUT_GRID):
                cb.update_curvature_matrix_estimate(
                    cst, {"inputs": xp.asarray(cdata["inputs"]),
                          "outputs_grad": xp.asarray(np.ones(bad))}, 0.0, 1.0, N)
    with pytest.raises(KFACTypeError, match="state must be a BlockState"):
        block.multiply(None, vec, 0.1, True, False)
    with pytest.raises(KFACValueError, match="approx_power_one must be one of"):
        kj.DenseTwoKroneckerFactored(3, 2, approx_power_one="pi")
    with pytest.raises(KFACValueError, match="shift_shape must broadcast"):
        kj.ScaleAndShiftFull((3, 2), (2,), (3,))


def test_approx_power_one_options(xp, rng):
    """kfac-jax (default): the approximate power 1 is π-damped; 'exact' gives sB + λI."""
    _, state, _, _ = make_state(xp, rng, "DenseTwoKroneckerFactored")
    vec, vh = random_vector(xp, rng, kj.DenseTwoKroneckerFactored(3, 2))
    fac = kj.DenseTwoKroneckerFactored(3, 2)
    ex = kj.DenseTwoKroneckerFactored(3, 2, approx_power_one="exact")
    dense = xp.to_numpy(fac.to_dense_matrix(state))
    got = flat(xp, ex.multiply(state, vec, 0.4, False, False))
    assert_allclose_normwise(got, (dense + 0.4 * np.eye(dense.shape[0])) @ vh, xp.rtol)
    got = flat(xp, fac.multiply(state, vec, 0.4, False, False))
    assert_allclose_normwise(got, approx_dense(xp, fac, state, 0.4) @ vh, xp.rtol)
    any_power = kj.DenseTwoKroneckerFactored(3, 2, restrict_approx_powers=False)
    got = flat(xp, any_power.multiply_matpower(state, vec, 0.4, 3.0, False, False))
    assert_allclose_normwise(got, dense_power(approx_dense(xp, fac, state, 0.4), 3.0) @ vh,
                             xp.rtol)


def test_scale_and_shift_variants(xp, rng):
    """Shift-only and scale-only layers; a (1, C) scale broadcast over a middle axis."""
    x = rng.standard_normal((N, 3, 2))
    g = rng.standard_normal((N, 3, 2))
    data = {"inputs": xp.asarray(x), "outputs_grad": xp.asarray(g)}
    xh, gh = xp.round_host(x), xp.round_host(g)
    cases = [
        (kj.ScaleAndShiftFull((3, 2), None, (2,)), gh.sum(axis=1)),
        (kj.ScaleAndShiftFull((3, 2), (3, 1), None), (xh * gh).sum(axis=2)),
        (kj.ScaleAndShiftFull((3, 2), (3, 2), (1, 2)),
         np.hstack([(xh * gh).reshape(N, -1), gh.sum(axis=1)])),
    ]
    for block, t in cases:
        st = block.init(xp.asarray(np.zeros(1)))
        st = block.update_curvature_matrix_estimate(st, data, 0.0, 1.0, N)
        xp.assert_close(block.to_dense_matrix(st), t.T @ t / N)


def test_symmetrize_option(xp, rng):
    """kfac-jax does not symmetrise the statistics, TF does: equal up to rounding."""
    conv_kw = dict(inputs_shape=(N, 3, 3, 1), kernel_shape=(2, 2, 1, 2))
    x = rng.standard_normal((N, 3, 3, 1))
    g = rng.standard_normal((N, 2, 2, 2))
    for make in (lambda **k: kj.DenseTwoKroneckerFactored(3, 2, **k),
                 lambda **k: kj.Conv2DTwoKroneckerFactored(**conv_kw, **k)):
        dense_case = make().input_size == 4
        data = ({"inputs": xp.asarray(x[:, 0, :, 0]), "outputs_grad": xp.asarray(g[:, 0, :, 0])}
                if dense_case else {"inputs": xp.asarray(x), "outputs_grad": xp.asarray(g)})
        mats = []
        for sym in (True, False):
            b = make(symmetrize=sym)
            st = b.update_curvature_matrix_estimate(b.init(xp.asarray(np.zeros(1))), data, 0.0,
                                                    1.0, N)
            mats.append(xp.to_numpy(b.to_dense_matrix(st)))
        assert_allclose_normwise(mats[1], mats[0], xp.rtol)  # differ by rounding only


@pytest.mark.parametrize(("name", "symmetrize"), [
    ("Conv2DDiagonal", True), ("Conv2DFull", True), ("Conv2DTwoKroneckerFactored", True),
    ("Conv2DTwoKroneckerFactored", False)])
def test_conv_blocks_same_for_nchw_and_nhwc(xp, rng, name, symmetrize):
    """One convolution, two layouts: the NCHW block fed the transposed inputs and gradients has
    the NHWC block's dense matrix (the statistics are layout-free; kills an NCHW path that
    reads channels as a spatial axis)."""
    kw = {"symmetrize": symmetrize} if name == "Conv2DTwoKroneckerFactored" else {}
    cls = getattr(kj, name)
    x = rng.standard_normal((N, 3, 3, 1))
    g = rng.standard_normal((N, 2, 2, 2))
    mats = []
    for fmt, xx, gg in (("NHWC", x, g),
                        ("NCHW", x.transpose(0, 3, 1, 2), g.transpose(0, 3, 1, 2))):
        b = cls(inputs_shape=xx.shape, kernel_shape=(2, 2, 1, 2), data_format=fmt, **kw)
        st = b.update_curvature_matrix_estimate(
            b.init(xp.asarray(np.zeros(1))),
            {"inputs": xp.asarray(np.ascontiguousarray(xx)),
             "outputs_grad": xp.asarray(np.ascontiguousarray(gg))}, 0.0, 1.0, N)
        mats.append(xp.to_numpy(b.to_dense_matrix(st)))
    assert_allclose_normwise(mats[1], mats[0], xp.rtol)


def test_conv_block_output_channel_error_names_kernel_shape(rng):
    """The kfac-jax conv blocks take ``kernel_shape``: a cotangent with the wrong C_out is
    reported against that argument (TF-named blocks say ``filter_shape``)."""
    block = kj.Conv2DTwoKroneckerFactored((N, 3, 3, 1), (2, 2, 1, 2))
    x = _conv_in(rng, N, 3, 3, 1)
    st = block.init(x)
    with pytest.raises(KFACValueError, match=r"outputs_grad and kernel_shape must agree on "
                       r"out_channels; outputs_grad has 3 but kernel_shape is \(2, 2, 1, 2\)"):
        block.update_curvature_matrix_estimate(
            st, {"inputs": x, "outputs_grad": rng.standard_normal((N, 2, 2, 3))}, 0.0, 1.0, N)


def test_a_failing_cache_refresh_runs_once_on_numpy(monkeypatch):
    """NumPy reads a refresh's value checks at once: the first failure is the error, named
    by the block, and the refresh is not computed a second time to find it (other
    libraries defer the checks and compute again only after a failed read)."""
    block = kj.DenseTwoKroneckerFactored(2, 2, has_bias=False)
    state = block.init(np.zeros(1), approx_powers_to_cache=-1.0)
    passes, real = [], kj.DenseTwoKroneckerFactored._cache_entries
    monkeypatch.setattr(kj.DenseTwoKroneckerFactored, "_cache_entries",
                        lambda self, *a: passes.append(1) or real(self, *a))
    with pytest.raises(KFACValueError, match=r"^DenseTwoKroneckerFactored\.update_cache: a "
                                             r"Kronecker factor is zero and damping is 0"):
        block.update_cache(state, 0.0, None, -1.0, False)
    assert passes == [1]


def test_block_state_answers_to_kfac_jax_names():
    """kfac-jax's state attributes read the same averages: ``factors`` (Kronecker),
    ``diagonal_factors`` (diagonal), ``matrix`` (full)."""
    like = np.zeros(())
    kron = kj.DenseTwoKroneckerFactored(3, 2).init(like)
    diag = kj.DenseDiagonal(3, 2).init(like)
    full = kj.DenseFull(3, 2).init(like)
    assert kron.factors is kron.statistics and len(kron.factors) == 2
    assert diag.diagonal_factors is diag.statistics
    assert full.matrix is full.statistics[0]
    assert full.matrix.raw.shape == (8, 8)  # a 3 × 2 weight and a bias of 2
