"""The case catalogue: one module per capability family.

Each family module defines ``REQUIRES`` (the kfac_ref modules its cases need),
``CAPABILITIES`` (importable without kfac_ref, so golden files can be checked anywhere) and
``build_cases()`` (computes the expected outputs with kfac_ref in float64).  A family whose
kfac_ref modules are not importable is absent from the catalogue, with the reason recorded.
"""

from __future__ import annotations

import importlib

from ..model import Capability, Case

__all__ = ["FAMILY_MODULES", "FUNCTIONS", "capabilities", "build_catalogue", "family_status",
           "describe_functions", "functions_checked"]

#: family name -> module (relative to this package), in report order
FAMILY_MODULES = {
    "linalg": ".linalg_cases",
    "averaging": ".averaging_cases",
    "factors": ".factors_cases",
    "losses": ".losses_cases",
    "blocks": ".blocks_cases",
    "estimator": ".estimator_cases",
    "networks": ".networks_cases",
    "sampling": ".sampling_cases",
    "optimizer": ".optimizer_cases",
    "laplace": ".laplace_cases",
}


_EST = "kfac_ref.curvature.BlockDiagonalCurvature"
_LOSS = "kfac_ref.losses.NegativeLogProbLoss"
#: capability -> the public kfac_ref functions (or methods) whose numbers it checks: the
#: reference computes each case's expected output with them, and an implementation passes
#: when it agrees.  A capability's name is the suite's, not a kfac_ref function's
#: (``linalg.homog_cov`` is ``compute_cov(append_homog(a))``); the last element may be a
#: note on the arguments.  Every dotted name imports
#: (tests/conformance/test_conformance_cli_help.py).
FUNCTIONS: dict[str, tuple[str, ...]] = {
    "linalg.compute_cov": ("kfac_ref.linalg.compute_cov",),
    "linalg.cross_cov": ("kfac_ref.linalg.compute_cov", "(x, y)"),
    "linalg.homog_cov": ("kfac_ref.linalg.compute_cov", "kfac_ref.linalg.append_homog"),
    "linalg.kron": ("kfac_ref.linalg.kron",),
    "linalg.kron_matvec": ("kfac_ref.linalg.kron_matvec",),
    "linalg.damped_matpower": ("kfac_ref.linalg.damped_matpower",),
    "linalg.damped_inverse": ("kfac_ref.linalg.damped_inverse",),
    "linalg.pi_tracenorm": ("kfac_ref.linalg.pi_tracenorm",),
    "linalg.pi_adjusted_damping": ("kfac_ref.linalg.pi_adjusted_damping",),
    "linalg.factored_damped_inverse_matvec": ("kfac_ref.linalg.kron_damped_inverse_matvec",
                                              'damping_method="factored"'),
    "linalg.exact_damped_inverse_matvec": ("kfac_ref.linalg.kron_damped_inverse_matvec",
                                           'damping_method="exact"'),
    "linalg.factored_damped_matpower_matvec": ("kfac_ref.linalg.kron_damped_matpower_matvec",
                                               'damping_method="factored"'),
    "linalg.factor_norm": ("kfac_ref.linalg.factor_norm",),
    "averaging.ema": ("kfac_ref.averaging.MovingAverageVariable.update",),
    "factors.dense_input": ("kfac_ref.factors.fully_connected_kronecker_factor",),
    "factors.dense_output": ("kfac_ref.factors.fully_connected_kronecker_factor",),
    "factors.dense_diagonal": ("kfac_ref.factors.fully_connected_diagonal_factor",),
    "factors.conv_input": ("kfac_ref.factors.conv_input_kronecker_factor",),
    "factors.conv_output": ("kfac_ref.factors.conv_output_kronecker_factor",),
    "factors.conv_diagonal": ("kfac_ref.factors.conv_diagonal_factor",),
    "factors.embedding_input": ("kfac_ref.factors.embedding_input_kronecker_factor",),
    "factors.naive_diagonal": ("kfac_ref.factors.naive_diagonal_factor",),
    "factors.series_cov_dt1": ("kfac_ref.factors.fully_connected_multi_kf_cov_dt1",),
    "losses.fisher": (f"{_LOSS}.fisher_matrix", "of the five losses"),
    "losses.gradient": ("kfac_ref.losses.LossFunction.grad_of_evaluate", "of the five losses"),
    "losses.hessian": (f"{_LOSS}.hessian_matrix", "of the five losses"),
    "losses.fisher_factor": (f"{_LOSS}.multiply_fisher_factor", "of the five losses"),
    "losses.fisher_factor_transpose": (f"{_LOSS}.multiply_fisher_factor_transpose",
                                       "of the five losses"),
    "losses.ggn_factor": ("kfac_ref.losses.LossFunction.multiply_ggn_factor",
                          "of the five losses"),
    "losses.sample": (f"{_LOSS}.sample", "of the five losses"),
    "blocks.kron_matpower": ("kfac_ref.blocks.kronecker_block_matpower",),
    "blocks.kron_eigenvalues": ("kfac_ref.blocks.kronecker_block_eigenvalues",),
    "blocks.diagonal_matpower": ("kfac_ref.blocks.diagonal_block_matpower",),
    "blocks.series_inverse": ("kfac_ref.blocks.tf.FullyConnectedSeriesFB.multiply_matpower",),
    "blocks.kron_cached_inverse": (
        "kfac_ref.blocks.kfac_jax.DenseTwoKroneckerFactored.update_cache",
        "kfac_ref.blocks.kfac_jax.DenseTwoKroneckerFactored.multiply_matpower"),
    "estimator.kfac_ema": (f"{_EST}.update_curvature_matrix_estimate",
                           f"{_EST}.to_dense_matrix"),
    "estimator.full_blocks": (f"{_EST}.update_curvature_matrix_estimate",
                              "kfac_ref.blocks.kfac_jax.DenseFull",
                              "kfac_ref.blocks.kfac_jax.NaiveFull",
                              "kfac_ref.blocks.kfac_jax.DenseDiagonal",
                              "kfac_ref.blocks.kfac_jax.NaiveDiagonal"),
    "networks.ggn": ("kfac_ref.curvature.ggn_matrix",),
    "networks.empirical_fisher": ("kfac_ref.curvature.empirical_fisher_matrix",),
    "networks.kfac": (f"{_EST}.update_curvature_matrix_estimate", f"{_EST}.to_dense_matrix"),
    "networks.kfac_input_factors": (f"{_EST}.update_curvature_matrix_estimate",
                                    "(the blocks' input factors)"),
    "networks.kfac_output_factors": (f"{_EST}.update_curvature_matrix_estimate",
                                     "(the blocks' output factors)"),
    "networks.kfac_inverse_matvec": (f"{_EST}.multiply_matpower", "power=-1"),
    "sampling.kfac": (f"{_EST}.update_curvature_matrix_estimate", f"{_EST}.to_dense_matrix",
                      "sampling estimation modes"),
    "optimizer.kfac_steps": ("kfac_ref.optim.KFACOptimizer.step",),
    "laplace.log_marginal_likelihood": ("kfac_ref.laplace.laplace_log_marginal_likelihood",
                                        "five curvature structures"),
    "laplace.prior_precision_grad": ("kfac_ref.laplace.laplace_log_marginal_likelihood_grad",
                                     "five curvature structures"),
}


def functions_checked(capability: str) -> tuple[str, ...]:
    """The dotted names of the public kfac_ref functions ``capability`` checks (notes on the
    arguments dropped); empty for a capability the table does not know."""
    return tuple(f for f in FUNCTIONS.get(capability, ()) if f.startswith("kfac_ref."))


def describe_functions(capability: str) -> str:
    """``FUNCTIONS[capability]`` as one phrase: the names, then the note in brackets."""
    items = FUNCTIONS.get(capability, ())
    names = [f for f in items if f.startswith("kfac_ref.")]
    notes = [f.strip("()") for f in items if not f.startswith("kfac_ref.")]
    return ", ".join(names) + (f" ({'; '.join(notes)})" if notes else "")


def _family_module(family):
    try:
        return importlib.import_module(FAMILY_MODULES[family], __name__), None
    except ModuleNotFoundError as exc:
        return None, f"catalogue module missing ({exc})"


def family_status(family) -> tuple[bool, str]:
    """(available, reason): whether the family's kfac_ref modules import."""
    mod, why = _family_module(family)
    if mod is None:
        return False, why
    for req in getattr(mod, "REQUIRES", ()):
        try:
            importlib.import_module(req)
        except Exception as exc:  # ImportError, or an error raised while importing
            return False, f"{req} is not importable ({type(exc).__name__}: {exc})"
    return True, ""


def capabilities() -> dict[str, Capability]:
    """Every capability the suite knows (whether or not kfac_ref can build its cases)."""
    out = {}
    for family in FAMILY_MODULES:
        mod, _ = _family_module(family)
        if mod is None:
            continue
        for cap in mod.CAPABILITIES:
            out[cap.name] = cap
    return out


def build_catalogue(families=None) -> tuple[list[Case], dict[str, str]]:
    """Build the live catalogue: (cases, absent families -> reason)."""
    cases, absent = [], {}
    for family in FAMILY_MODULES:
        if families and family not in families:
            continue
        ok, why = family_status(family)
        if not ok:
            absent[family] = why
            continue
        mod, _ = _family_module(family)
        caps = {c.name: c for c in mod.CAPABILITIES}
        try:
            cases.extend(finalize(c, caps.get(c.capability)) for c in mod.build_cases())
        except Exception as exc:  # a module that imports but whose API moved under us
            absent[family] = f"building the cases failed ({type(exc).__name__}: {exc})"
    return cases, absent


def finalize(case: Case, cap: Capability | None = None) -> Case:
    """Move alternatives that the case cannot tell apart from the expected output (within its
    own float64 tolerance) to ``meta["insensitive_to"]``, and list there too the undeclared
    conventions that change nothing in this case: a pitfall that changes nothing in a case
    must not be diagnosed there, and a mutant with that pitfall must pass it."""
    import numpy as np

    from ..conventions import CANONICAL
    from ..diagnosis import _flip_candidates

    rtol = case.tolerance.rtol()
    keep, insensitive = {}, list(case.meta.get("insensitive_to", ()))
    den = max(float(np.linalg.norm(case.expected)), case.tolerance.scale, 1e-300)

    def same(arr):
        return arr.shape == case.expected.shape and \
            float(np.linalg.norm(arr - case.expected)) / den <= rtol

    for name, alt in case.alternatives.items():
        if name.startswith("_"):  # conversion data of a convention: always kept
            keep[name] = alt
        elif same(alt):
            insensitive.append(name)
        else:
            keep[name] = alt
    case.alternatives = keep
    if cap is not None:
        verdicts: dict[str, bool] = {}
        for pid, _, cand in _flip_candidates(cap, case, CANONICAL):
            verdicts[pid] = verdicts.get(pid, True) and same(cand)
        insensitive += [pid for pid, all_same in verdicts.items() if all_same]
    if insensitive:
        case.meta["insensitive_to"] = sorted(set(insensitive))
    return case
