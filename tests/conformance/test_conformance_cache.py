"""blocks.kron_cached_inverse: the cache semantics of kfac-jax's Kronecker blocks (a cached
product after a further update uses the stale inverse), against dense formulas and through
kfac_ref's stateful block on every backend cell."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conformance.catalogue import build_catalogue
from conformance.catalogue.blocks_cases import cached_inverse_block


@pytest.fixture(scope="module")
def cases():
    return [c for c in build_catalogue(["blocks"])[0]
            if c.capability == "blocks.kron_cached_inverse"]


def _dense(case):
    """Dense oracle: explicit Kronecker matrices, trace-norm π, numpy.linalg.solve."""
    i, prm = case.inputs, case.params
    a0, g0, x = i["a0"], i["g0"], i["x"]
    p, q = x.shape
    if prm["exact"]:
        m = np.kron(a0, g0) + prm["damping"] * np.eye(p * q)
    else:
        pi = math.sqrt((np.trace(a0) / p) / (np.trace(g0) / q))
        root = math.sqrt(prm["damping_cached"])
        m = np.kron(a0 + pi * root * np.eye(p), g0 + root / pi * np.eye(q))
    return np.linalg.solve(m, x.reshape(-1)).reshape(p, q)


def test_expected_is_the_stale_inverse(cases):
    assert {c.params["exact"] for c in cases} == {False, True}
    for c in cases:
        assert np.linalg.norm(c.expected - _dense(c)) <= 1e-12 * np.linalg.norm(c.expected)
        # the stale and the fresh product differ by far more than rounding
        fresh = c.alternatives["fresh_instead_of_cached"]
        assert np.linalg.norm(fresh - c.expected) > 1e-2 * np.linalg.norm(c.expected)


def test_stateful_block_on_every_backend(cases, xp):
    for c in cases:
        got = cached_inverse_block(c.inputs, c.params, xp.asarray, xp.to_numpy)
        assert np.linalg.norm(got - c.expected) <= c.tolerance.rtol(xp.eps) * np.linalg.norm(
            c.expected), c.id
