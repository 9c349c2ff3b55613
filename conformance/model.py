"""Data model of the suite: capabilities, cases and tolerances.

A **capability** is one quantity an implementation can compute (a covariance, a Kronecker
block, a damped inverse applied to a vector, a moving average, ...).  It says which
conventions can change its numbers and how to convert the reference's canonical inputs and
outputs into declared conventions.

A **case** is one named instance of a capability: host (NumPy float64) inputs, JSON scalar
parameters, the expected output computed by kfac_ref in float64, named *alternatives* (what
a known pitfall would produce, also computed by kfac_ref), metadata used by the diagnosis
(batch size N, number of locations T, factor sizes p, q) and a tolerance whose derivation is
written down.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .conventions import Conventions

__all__ = ["Tolerance", "Case", "Capability", "SAFETY", "seed_for", "EPS64"]

EPS64 = float(np.finfo(np.float64).eps)
EPS32 = float(np.finfo(np.float32).eps)

#: Constant c in every error budget c · work · κ (backward-stable algorithms have errors of
#: a small multiple of work · κ · eps; 16 covers the constants of GEMM/eigh/Cholesky at the
#: sizes used here while staying far below any pitfall's effect, which is O(1) relative).
SAFETY = 16.0


@dataclass(frozen=True)
class Tolerance:
    """Norm-wise tolerance ``‖actual − expected‖_F ≤ rtol · max(‖expected‖_F, scale)``.

    ``budget`` is dimensionless (``SAFETY · work · κ``); the relative tolerance for an
    implementation computing in a floating type with unit roundoff ``eps`` is
    ``budget · eps`` (plus the adapter's declared hyper-parameter precision).  ``scale`` is a
    floor for the reference norm (for outputs that may be near zero) and ``derivation`` says
    in words where ``work`` and ``κ`` come from.
    """

    budget: float
    derivation: str
    scale: float = 0.0

    def rtol(self, eps: float = EPS64, extra: float = 0.0) -> float:
        return self.budget * eps + extra

    def to_dict(self) -> dict:
        return {"budget": self.budget, "rtol_float64": self.rtol(), "scale": self.scale,
                "derivation": self.derivation}

    @classmethod
    def from_dict(cls, d) -> Tolerance:
        return cls(float(d["budget"]), str(d["derivation"]), float(d.get("scale", 0.0)))


@dataclass
class Case:
    """One named instance of a capability."""

    id: str
    capability: str
    inputs: dict[str, np.ndarray]
    params: dict[str, Any]
    expected: np.ndarray
    tolerance: Tolerance
    meta: dict[str, Any] = field(default_factory=dict)
    alternatives: dict[str, np.ndarray] = field(default_factory=dict)
    description: str = ""
    source: str = "live"  # "live" (computed now by kfac_ref) or "golden" (loaded from files)

    @property
    def family(self) -> str:
        return self.capability.split(".", 1)[0]


def _identity_inputs(inputs, case, conv):
    return dict(inputs)


def _identity_output(arr, case, conv):
    return arr


@dataclass(frozen=True)
class Capability:
    """One quantity the suite can check.

    Attributes
    ----------
    name : str
        ``family.quantity`` (e.g. ``linalg.kron``).
    summary : str
        What the implementation must return, with shapes, in canonical conventions.
    signature : str
        The adapter function's inputs (names of ``inputs`` arrays and ``params`` keys).
    conventions : tuple of str
        Convention fields that change this capability's numbers or layout.
    convert_inputs, convert_output : callables
        ``(inputs | array, case, conventions) -> converted``: move the canonical inputs /
        the reference's output (or an alternative) into declared conventions.
    requires : tuple of str
        kfac_ref modules the catalogue needs to build its cases.
    draws : tuple of str
        Names of ``inputs`` that are random draws (a sampling estimator's sampled targets or
        sign vectors).  An adapter that lists the capability in ``Adapter.accepts_draws``
        gets them and is compared exactly; any other adapter gets the inputs without them
        and ``params["seed"]``, and is tested statistically (:mod:`conformance.sampling`).
    """

    name: str
    summary: str
    signature: str
    conventions: tuple = ()
    convert_inputs: Callable = _identity_inputs
    convert_output: Callable = _identity_output
    requires: tuple = ()
    draws: tuple = ()
    statistic: Callable | None = None

    @property
    def random(self) -> bool:
        """Whether the capability's output is random (draws or a sampler)."""
        return bool(self.draws) or self.statistic is not None

    @property
    def family(self) -> str:
        return self.name.split(".", 1)[0]

    def expected_for(self, case: Case, conv: Conventions) -> np.ndarray:
        return np.asarray(self.convert_output(case.expected, case, conv), dtype=np.float64)

    def inputs_for(self, case: Case, conv: Conventions) -> dict:
        return self.convert_inputs(case.inputs, case, conv)


def seed_for(case_id: str) -> int:
    """Deterministic seed from a case id (stable across Python versions and machines)."""
    return int.from_bytes(hashlib.sha256(case_id.encode()).digest()[:8], "little")


def rng_for(case_id: str) -> np.random.Generator:
    return np.random.default_rng(seed_for(case_id))
