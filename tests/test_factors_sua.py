"""SUA conv input factor (KFC Theorem 4, TF master): statistics against explicit pixel
sums, the dense structure against an entry-by-entry construction, exactness for 1×1
kernels, Sherman–Morrison inverse against a dense inverse, TF's channel-slow order, and
the stateful class (stale inverse, zero-mean option)."""

import itertools

import numpy as np
import pytest

import kfac_ref.factors as F
from kfac_ref import KFACValueError


def sua_dense_loop(sigma, mu, k, has_bias, damping, channel_fastest=True):
    c = sigma.shape[0]
    dim = k * c + has_bias
    out = np.zeros((dim, dim))

    def idx(off, ch):
        return off * c + ch if channel_fastest else ch * k + off

    for (o1, c1), (o2, c2) in itertools.product(itertools.product(range(k), range(c)),
                                                repeat=2):
        val = (mu[c1] * mu[c2] if mu is not None else 0.0)
        if o1 == o2:
            val += sigma[c1, c2] + (damping if c1 == c2 else 0.0)
        out[idx(o1, c1), idx(o2, c2)] = val
    if has_bias:
        for o, ch in itertools.product(range(k), range(c)):
            m = mu[ch] if mu is not None else 0.0
            out[idx(o, ch), -1] = out[-1, idx(o, ch)] = m
        out[-1, -1] = damping + (1.0 if mu is not None else 0.0)
    return out


def test_sua_statistics(xp, rng):
    x = xp.round_host(rng.standard_normal((3, 4, 5, 2)) + 0.5)
    pix = x.reshape(-1, 2)
    mu = pix.mean(axis=0)
    sigma = pix.T @ pix / len(pix) - np.outer(mu, mu)
    s, m = F.conv_input_sua_statistics(xp.asarray(x))
    xp.assert_close(s, sigma)
    xp.assert_close(m, mu)
    s2, _ = F.conv_input_sua_statistics(xp.asarray(np.moveaxis(x, -1, 1)), "NCHW",
                                        subtract_mean=False)
    xp.assert_close(s2, pix.T @ pix / len(pix))


@pytest.mark.parametrize("order", ["channel_fastest", "tf"])
@pytest.mark.parametrize("has_bias", [False, True])
def test_sua_dense_structure_and_inverse(xp, rng, has_bias, order):
    a = rng.standard_normal((5, 3))
    sigma = xp.round_host(a.T @ a / 5)
    mu = xp.round_host(rng.standard_normal(3))
    lam = 0.3
    expected = sua_dense_loop(sigma, mu, 4, has_bias, lam, order == "channel_fastest")
    got = F.conv_input_sua_factor(xp.asarray(sigma), xp.asarray(mu), 4, has_bias, lam, order)
    xp.assert_close(got, expected)
    inv = F.conv_input_sua_inverse(xp.asarray(sigma), xp.asarray(mu), 4, has_bias, lam, order)
    # the damped factor (n ≤ 13) has κ of a few hundred (eigenvalues from λ = 0.3 up to
    # ~K|μ|² + ‖Σ‖), beyond the fixture's n·κ ≤ 4096 budget: allow 10× that
    xp.assert_close(inv, np.linalg.inv(expected), rtol=xp.rtol * 10)
    no_mu = F.conv_input_sua_factor(xp.asarray(sigma), None, 4, has_bias, lam, order)
    xp.assert_close(no_mu, sua_dense_loop(sigma, None, 4, has_bias, lam,
                                          order == "channel_fastest"))


def test_sua_exact_for_pointwise_kernels(xp, rng):
    """For a 1×1 kernel the SUA factor is the KFC input factor itself: Σ + μμᵀ = E[x xᵀ]."""
    x = xp.asarray(rng.standard_normal((3, 4, 4, 2)) + 1.0)
    f = F.ConvInputSUAKroneckerFactor((1, 1, 2, 3), has_bias=True).update_cov(x, ema_decay=0.5)
    exact = F.conv_input_kronecker_factor(x, (1, 1, 2, 3), "VALID", has_bias=True)
    xp.assert_close(f.get_matpower(1, 0.0), xp.to_numpy(exact))


def test_sua_class_averages_towers(xp, rng):
    """Per-tower Σ_t and μ_t (explicit pixel sums) are averaged over towers before the EMA."""
    xs = [xp.round_host(rng.standard_normal((2, 3, 4, 2)) + off) for off in (0.4, -0.3)]
    f = F.ConvInputSUAKroneckerFactor((2, 2, 2, 3)).update_cov([xp.asarray(v) for v in xs],
                                                                ema_decay=0.5)
    sig, mus = [], []
    for v in xs:
        pix = v.reshape(-1, 2)
        mu = pix.mean(axis=0)
        mus.append(mu)
        sig.append(sum(np.outer(q, q) for q in pix) / len(pix) - np.outer(mu, mu))
    xp.assert_close(f.cov, (sig[0] + sig[1]) / 2)
    xp.assert_close(f.mu, (mus[0] + mus[1]) / 2)


def test_sua_class_stale_inverse_and_zero_mean(xp, rng):
    x1 = xp.asarray(rng.standard_normal((2, 4, 4, 2)) + 0.3)
    x2 = xp.asarray(rng.standard_normal((2, 4, 4, 2)) - 0.2)
    f = F.ConvInputSUAKroneckerFactor((3, 3, 2, 4), has_bias=True).register_inverse(0.2)
    f1 = f.update_cov(x1, ema_decay=0.9).update_inverses()
    dense1 = xp.to_numpy(f1.get_matpower(1, 0.2))
    xp.assert_close(f1.get_inverse(0.2), np.linalg.inv(dense1), rtol=xp.rtol * 10)
    f2 = f1.update_cov(x2, ema_decay=0.9)
    xp.assert_close(f2.get_inverse(0.2), np.linalg.inv(dense1), rtol=xp.rtol * 10)  # stale
    s = [F.conv_input_sua_statistics(v) for v in (x1, x2)]
    xp.assert_close(f2.cov, (0.9 * xp.to_numpy(s[0][0]) + xp.to_numpy(s[1][0])) / 1.9)
    xp.assert_close(f2.mu, (0.9 * xp.to_numpy(s[0][1]) + xp.to_numpy(s[1][1])) / 1.9)
    z = F.ConvInputSUAKroneckerFactor((2, 2, 2, 4), assume_zero_mean_activations=True,
                                      subtract_mean_contrib_from_cov=False)
    z = z.update_cov(x1, ema_decay=0.0)
    assert z.mu is None
    pix = xp.to_numpy(x1).reshape(-1, 2)
    xp.assert_close(z.get_matpower(1, 0.0), np.kron(np.eye(4), pix.T @ pix / len(pix)))
    with pytest.raises(KFACValueError, match="only inverses"):
        f.register_matpower(-0.5, 0.1)
    with pytest.raises(KFACValueError, match="Cholesky"):
        f.register_cholesky(0.1)
    with pytest.raises(KFACValueError, match="in_channels"):
        f.update_cov(xp.asarray(rng.standard_normal((2, 4, 4, 3))), ema_decay=0.5)
    with pytest.raises(KFACValueError, match="damping must be positive"):
        F.conv_input_sua_inverse(xp.asarray(np.eye(2)), xp.asarray(np.ones(2)), 4, True, 0.0)
    with pytest.raises(KFACValueError, match="sigma must be .*symmetric"):
        F.conv_input_sua_factor(xp.asarray(np.array([[1.0, 0.5], [0.0, 1.0]])), None, 4)
    with pytest.raises(KFACValueError, match="sigma must be .*symmetric"):
        F.conv_input_sua_inverse(xp.asarray(np.array([[1.0, 0.5], [0.0, 1.0]])), None, 4,
                                 damping=0.1)
    with pytest.raises(KFACValueError, match="order"):
        F.conv_input_sua_factor(xp.asarray(np.eye(2)), None, 4, order="spatial_fastest")


def test_sua_channel_fastest_order_matches_kfc_for_uncorrelated_locations():
    """Pixels iid across locations (SUA holds in the population), channels correlated: the
    channel-fastest SUA factor estimates the exact KFC Ω; TF's channel-slow layout does not
    (Grosse & Martens 2016, §4.2).  Monte-Carlo: 400 images × 25 VALID locations; the sampling
    error of these second moments is ~sqrt(2/M) ≈ 1.4% for M = 10⁴ (less with overlapping
    patches), so 5% is a 3.5σ bound, while the layout error is O(1)."""
    rng = np.random.default_rng(0)
    chol = np.array([[1.0, 0.0, 0.0], [0.9, 0.4, 0.0], [0.5, 0.3, 0.2]])
    x = rng.standard_normal((400, 6, 6, 3)) @ chol.T + np.array([0.5, -0.3, 0.2])
    exact = F.conv_input_kronecker_factor(x, (2, 2, 3, 1), "VALID", has_bias=True)

    def err(order):
        f = F.ConvInputSUAKroneckerFactor((2, 2, 3, 1), has_bias=True, order=order)
        s = f.update_cov(x, ema_decay=0.0).get_matpower(1, 0.0)
        return np.abs(s - exact).max() / np.abs(exact).max()

    assert err("channel_fastest") < 0.05
    assert err("tf") > 0.3
