"""Per-layer comparison of a user's K-FAC factors with the reference, and the diagnosis
of each disagreement."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ._reference import _hwc_to_chw, _np

#: what a named pitfall means for a hand-written K-FAC (appended to the diagnosis)
HINTS = {
    "patch_order": "patch vector ordered (kh, kw, C_in) with C_in fastest (TF/JAX HWC) "
                   "instead of unfold's (C_in, kh, kw) with the channel slowest",
    "bias_position": "the bias's homogeneous coordinate first instead of last",
    "scale:1/N^2": "gradients of the mean-reduced loss used as per-example gradients "
                   "(multiply them by N)",
    "scale:1/T": "normalised by N·|T| instead of N: TF ConvKFCBasicFB's Γ = G/|T| "
                 "(F = |T|·(A⊗Γ)), or the |T| factor of KFAC-expand missing",
    "scale:T": "normalised by N instead of N·|T| (BackPACK's Σ/N), or an extra |T|",
    "empirical_fisher": "the empirical Fisher (gradient at the data label) where the "
                        "Fisher of the model's own predictive distribution is asked",
    "true_fisher": "the exact (true) Fisher where another estimate is asked",
}


@dataclass
class LayerCheck:
    """One factor of one layer: agreement with the reference, or the diagnosed pitfall."""

    layer: str
    factor: str
    ok: bool
    rel_err: float
    rtol: float
    diagnosis: str = ""
    explanation: str = ""

    def line(self) -> str:
        head = f"{self.layer}.{self.factor}: "
        if self.ok:
            return head + f"ok (relative error {self.rel_err:.1e} <= {self.rtol:.1e})"
        return head + (f"FAIL relative error {self.rel_err:.3e} > {self.rtol:.1e}; "
                       f"diagnosis: {self.diagnosis}: {self.explanation}")


@dataclass
class ModelCheck:
    """Every :class:`LayerCheck` of a model; ``ok`` when every factor agrees."""

    mode: str
    checks: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def __str__(self) -> str:
        lines = [f"K-FAC factors against the reference (mode {self.mode}): "
                 f"{'all agree' if self.ok else 'DISAGREE'}"]
        return "\n".join(lines + ["  " + c.line() for c in self.checks])


def layer_alternatives(name, ref, others, mode, sharing):
    """What each pitfall would give for layer ``name``: ``{"A": {pitfall: array}, "G": ...}``.

    ``ref`` is the layer's reference entry, ``others`` maps ``"empirical_fisher"``,
    ``"true_fisher"`` and ``"sharing"`` to whole-model references computed the other way
    (any may be missing).  A conv layer adds the kfac_ref (HWC) patch order, alone and with
    the bias first."""
    alts = {"A": {}, "G": {}}
    a = ref["A"]
    bias = ref.get("bias", True)
    if bias and a.shape[0] > 1:
        perm = np.r_[a.shape[0] - 1, 0:a.shape[0] - 1]  # homogeneous coordinate first
        alts["A"]["bias_position"] = a[np.ix_(perm, perm)]
    if ref.get("kind") == "conv2d":
        kh, kw = ref["kernel"]
        chw = _hwc_to_chw(ref["c_in"], kh, kw, bias)  # chw entry <- hwc index
        idx = chw if ref.get("order", "chw") == "hwc" else np.argsort(chw)
        other = a[np.ix_(idx, idx)]  # A in the other patch order
        if not np.allclose(other, a, rtol=1e-12, atol=0):
            alts["A"]["patch_order"] = other
            if bias:
                p = np.r_[a.shape[0] - 1, 0:a.shape[0] - 1]
                alts["A"]["patch_order+bias_position"] = other[np.ix_(p, p)]
    for key in ("empirical_fisher", "true_fisher"):
        if key in others:
            alts["G"][key] = others[key][name]["G"]
    other_sh = others.get("sharing")
    if other_sh is not None and ref["T"] > 1:
        key = f"{'reduce' if sharing == 'expand' else 'expand'}_instead_of_{sharing}"
        alts["A"][key] = other_sh[name]["A"]
        alts["G"][key] = other_sh[name]["G"]
    return alts


def _hint(pitfall):
    parts = [HINTS[p] for p in pitfall.split("+") if p in HINTS]
    return f" [{'; '.join(parts)}]" if parts else ""


def check_factors(ref, factors, alternatives, mode, fn="check_factors") -> ModelCheck:
    r"""Compare ``factors`` (``{layer: {"A": ..., "G": ...}}``) with the reference ``ref``
    (as :func:`reference_torch_kfac` returns) per layer and factor,

    .. math::

        \frac{\|X_\text{user} - X\|_F}{\|X\|_F} \le \text{rtol}
        = 16\,(N|T|K + d)\,\varepsilon ,

    (:math:`K = 1` for ``A``, :math:`d` the factor's size, :math:`\varepsilon` the unit
    roundoff of the user's floating type) and diagnose each disagreement with
    :func:`conformance.diagnosis.diagnose` against ``alternatives`` (as
    :func:`layer_alternatives` returns, per layer) and the scalar pitfalls of N and |T|."""
    from ..compare import compare
    from ..diagnosis import diagnose
    from ..model import EPS32, EPS64, SAFETY, Capability, Case, Tolerance

    if not isinstance(factors, dict) or not factors:
        raise ValueError(f"{fn}: factors must be a non-empty dict of layer name -> "
                         f"{{'A': ..., 'G': ...}}; got {factors!r:.80}.")
    unknown = sorted(set(factors) - set(ref))
    if unknown:
        raise ValueError(f"{fn}: factors must name supported layers of the model "
                         f"({', '.join(ref)}); got {', '.join(map(str, unknown))}.")
    cap = Capability("own_model.factor", "a K-FAC factor of the user's model", "")
    result = ModelCheck(mode)
    for name, user in factors.items():
        if not isinstance(user, dict) or not set(user) <= {"A", "G"}:
            raise ValueError(f"{fn}: factors[{name!r}] must be a dict with keys 'A' and/or "
                             f"'G'; got {user!r:.80}.")
        r = ref[name]
        meta = {"N": r["N"], "T": r["T"]}
        if r.get("kind") == "conv2d":
            meta.update(kernel=r["kernel"], c_in=r["c_in"])
        for fac in ("A", "G"):
            if fac not in user:
                continue
            x = _np(user[fac])
            exp = r[fac]
            if x.shape != exp.shape:
                raise ValueError(f"{fn}: factors[{name!r}][{fac!r}] must have shape "
                                 f"{exp.shape} (the model's layout); got {x.shape}.")
            eps = EPS32 if x.dtype in (np.float32, np.float16) else EPS64
            rows = r["N"] * r["T"] * (r["K"] if fac == "G" else 1)
            tol = Tolerance(SAFETY * (rows + exp.shape[0]),
                            "one sum of N·|T|·K outer products per entry, and the forward "
                            "and backward passes of the model")
            rtol = tol.rtol(eps)
            case = Case(f"{name}.{fac}", cap.name, {}, {}, exp, tol, meta=meta,
                        alternatives=alternatives[name][fac])
            c = compare(x.astype(np.float64), exp, rtol)
            check = LayerCheck(name, fac, c.ok, c.rel_err, rtol)
            if not c.ok:
                d = diagnose(x, case, cap, None, rtol)
                check.diagnosis = d.pitfall
                check.explanation = d.explanation + _hint(d.pitfall)
            result.checks.append(check)
    return result
