"""The case catalogue: one module per capability family.

Each family module defines ``REQUIRES`` (the kfac_ref modules its cases need),
``CAPABILITIES`` (importable without kfac_ref, so golden files can be checked anywhere) and
``build_cases()`` (computes the expected outputs with kfac_ref in float64).  A family whose
kfac_ref modules are not importable is absent from the catalogue, with the reason recorded.
"""

from __future__ import annotations

import importlib

from ..model import Capability, Case

__all__ = ["FAMILY_MODULES", "capabilities", "build_catalogue", "family_status"]

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
}


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
