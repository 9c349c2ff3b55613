"""estimator.full_blocks: kfac-jax's DenseFull / NaiveFull / DenseDiagonal / NaiveDiagonal
blocks in the block-diagonal estimator are the exact per-layer blocks (or their diagonals) of
the exact GGN / empirical Fisher (a different code path: networks.exact_matrix), on every
backend cell."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.catalogue import build_catalogue
from conformance.catalogue.estimator_cases import FULL_BLOCKS, full_blocks_matrix
from conformance.catalogue.networks_cases import _block_diagonal, exact_matrix


@pytest.fixture(scope="module")
def cases():
    return [c for c in build_catalogue(["estimator"])[0]
            if c.capability == "estimator.full_blocks"]


def test_every_block_class_has_a_case(cases):
    assert {c.params["block"] for c in cases} == set(FULL_BLOCKS)


def test_full_blocks_are_the_exact_blocks(cases):
    for c in cases:
        kind = "ggn" if c.params["mode"] == "ggn_exact" else "ef"
        ref = _block_diagonal(exact_matrix(c.params, c.inputs, kind), c.params["net"])
        if "Diagonal" in c.params["block"]:
            ref = np.diag(np.diag(ref))
        assert np.linalg.norm(c.expected - ref) <= 1e-13 * np.linalg.norm(ref), c.id
        # and K-FAC is a different matrix here (the case can tell them apart)
        alt = c.alternatives["kronecker_instead_of_exact"]
        assert np.linalg.norm(alt - c.expected) > 1e-2 * np.linalg.norm(c.expected)


def test_full_blocks_on_every_backend(cases, xp):
    for c in cases:
        got = full_blocks_matrix(c.params, c.inputs, xp.asarray, xp.to_numpy)
        err = np.linalg.norm(got - c.expected) / np.linalg.norm(c.expected)
        assert err <= c.tolerance.rtol(xp.eps), c.id
