r"""The statistical route for capabilities whose output is random (``Capability.draws``).

An adapter that cannot take the case's draws (it is not listed in ``Adapter.accepts_draws``)
draws its own: the suite calls it ``K = k·n`` times with ``params["seed"]`` = 0, 1, …, K − 1
and no draws among the inputs, and tests the estimates against the exact expectation
:math:`\mu` (for the sampling modes: the exact-mode K-FAC matrix) with the exact per-draw
variance :math:`\sigma^2` of the reference's estimator, entry by entry.

**The test (median of means, distribution-free).**  The K estimates are split into k groups
of n; for every entry e the statistic is the median :math:`\tilde X_e` of the k group means.
The entry passes when

.. math::

    |\tilde X_e - \mu_e| \le t_e = c\,\sigma_e/\sqrt n + \tau\,\|\mu\|_F ,

with :math:`\tau` the case's floating-point tolerance (the rounding of one estimate, for
entries whose variance is 0).

**False-alarm bound.**  Assume the adapter is correct — its K estimates are independent,
each with mean :math:`\mu` and per-entry variance :math:`\sigma^2` (the reference's: the
estimator is fixed by the mode, only the draws are the adapter's).  By Chebyshev's inequality a
group mean misses :math:`\mu_e` by more than :math:`c\sigma_e/\sqrt n` with probability at
most :math:`p = 1/c^2`, whatever the distribution.  The median misses by more than that only if
at least :math:`\lceil k/2\rceil` (k odd: :math:`(k+1)/2`) of the k independent group means do,
which has probability at most the binomial tail
:math:`B(k, p) = \sum_{i\ge (k+1)/2}\binom ki p^i(1-p)^{k-i}` (increasing in p, so p = 1/c² is
an upper bound).  A union bound (Bonferroni) over the m entries gives

.. math:: P(\text{false alarm}) \le m\,B(k, 1/c^2) \le \alpha = 10^{-6}

with c = 3 and k the smallest odd number for which this holds (:func:`plan`; k = 39 for
m = 961 entries).  No normality is assumed; the only assumptions are independence across seeds
and the variance of the estimator the mode defines.

**Power.**  An estimator whose mean is :math:`\mu'` fails with probability at least
:math:`1 - B(k, 1/c^2) \ge 1 - 10^{-6}` as soon as some entry has
:math:`|\mu'_e - \mu_e| > t_e + c\sigma'_e/\sqrt n` (by the same argument its own median is
within :math:`c\sigma'_e/\sqrt n` of :math:`\mu'_e` with that probability): with n = 64,
an estimate scaled by 2 fails when some entry has :math:`|\mu_e| > 1.13\,\sigma_e`, the empirical
Fisher (deterministic, :math:`\sigma' = 0`) when some entry has
:math:`|\mathrm{EF}_e - \mu_e| > 0.375\,\sigma_e`
(tests/conformance/test_conformance_sampling.py checks both on every case).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["ALPHA", "CHEBYSHEV_C", "GROUP_SIZE", "plan", "binomial_tail", "StatResult",
           "statistical_check", "NotDraws"]


class NotDraws(ValueError):
    """A sampler's output is not draws of its distribution: probabilities or expectations
    where samples are due, values outside the support (a class index that is no integer in
    [0, k), a one-hot row that is not 0/1 with a single 1, a Bernoulli entry that is not 0 or
    1), non-finite, complex, text or object values.  The runner reports the case as a
    failure diagnosed ``not_draws``."""

#: false-alarm probability bound of one statistical case
ALPHA = 1e-6
#: Chebyshev multiple c: a group mean misses by more than c·σ/√n with probability ≤ 1/c²
CHEBYSHEV_C = 3.0
#: draws per group (n)
GROUP_SIZE = 64


def binomial_tail(k: int, p: float) -> float:
    """P(Bin(k, p) ≥ (k + 1) // 2): the median of k values is off only if that many are."""
    j = (k + 1) // 2
    return sum(math.comb(k, i) * p ** i * (1.0 - p) ** (k - i) for i in range(j, k + 1))


def plan(m: int, alpha: float = ALPHA, c: float = CHEBYSHEV_C) -> int:
    """Smallest odd number of groups k with m · B(k, 1/c²) ≤ alpha."""
    if m < 1 or not 0 < alpha < 1 or c <= 1:
        raise ValueError(f"plan: need m ≥ 1, 0 < alpha < 1, c > 1; got {m}, {alpha}, {c}")
    k = 1
    while m * binomial_tail(k, 1.0 / c ** 2) > alpha:
        k += 2
    return k


@dataclass(frozen=True)
class StatResult:
    ok: bool
    median: np.ndarray  # per-entry median of group means (the estimate of the mean)
    statistic: float  # max_e |median_e − μ_e| / t_e (pass: ≤ 1)
    worst: tuple  # index of the entry that attains it
    rel_err: float  # ‖median − μ‖_F / ‖μ‖_F
    rel_tol: float  # ‖t‖_F / ‖μ‖_F (the statistical tolerance, for the diagnosis)
    mean_all: np.ndarray  # mean of all K estimates (the diagnosis fits scales to it)
    scale_tol: float  # 5 × a bound on the std of the fitted scale ⟨μ, mean_all⟩/‖μ‖²
    draws: int
    groups: int
    detail: str


def statistical_check(estimate, mean, var, float_rtol, *, group_size=GROUP_SIZE,
                      alpha=ALPHA, c=CHEBYSHEV_C) -> StatResult:
    """Median-of-means test of ``estimate(seed) -> array`` against ``mean`` (module docstring).

    ``mean`` and ``var`` are the exact mean and per-entry variance of one estimate (in the
    adapter's conventions); ``float_rtol`` the floating-point tolerance of one estimate.
    """
    mean = np.asarray(mean, dtype=np.float64)
    sd = np.sqrt(np.maximum(np.asarray(var, dtype=np.float64), 0.0))
    k = plan(mean.size, alpha, c)
    n = int(group_size)
    sums = np.zeros((k,) + mean.shape)
    seed = 0
    for g in range(k):
        for _ in range(n):
            x = np.asarray(estimate(seed), dtype=np.float64)
            if x.shape != mean.shape:
                raise ValueError(f"the estimate for seed {seed} has shape {x.shape}, "
                                 f"expected {mean.shape}")
            if not np.all(np.isfinite(x)):
                raise ValueError(f"the estimate for seed {seed} is not finite")
            sums[g] = sums[g] + x
            seed += 1
    med = np.median(sums / n, axis=0)
    norm = max(float(np.linalg.norm(mean)), np.finfo(np.float64).tiny)
    t = c * sd / math.sqrt(n) + float_rtol * norm
    ratio = np.abs(med - mean) / t
    worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(ratio)), ratio.shape))
    stat = float(ratio[worst])
    ok = stat <= 1.0
    detail = (f"median of {k} group means of {n} draws ({k * n} in all): max_e |median − μ|/t_e "
              f"= {stat:.3g} at entry {worst} (t_e = {c:g}σ_e/√{n} + rounding; false-alarm "
              f"bound {alpha:g}: Chebyshev per group, binomial median tail, Bonferroni over "
              f"{mean.size} entries)")
    # std of ⟨μ, mean_all⟩ ≤ Σ_e |μ_e| σ_e / √K (Cauchy-Schwarz over correlated entries)
    scale_tol = 5.0 * float(np.sum(np.abs(mean) * sd)) / (math.sqrt(k * n) * norm ** 2)
    return StatResult(ok, med, stat, worst, float(np.linalg.norm(med - mean)) / norm,
                      float(np.linalg.norm(t)) / norm, sums.sum(axis=0) / (k * n), scale_tol,
                      k * n, k, detail)
