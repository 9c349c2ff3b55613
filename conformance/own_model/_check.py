r"""Per-layer comparison of a user's K-FAC factors with the reference, block and factor
verdicts, declared conventions, and the diagnosis of each disagreement.

A layer's **block** verdict compares the user's :math:`A_u \otimes G_u` with the reference
block :math:`A \otimes G` (both in the declared conventions): ``ok`` when both factors
agree, ``equivalent`` when the factors differ by scalars that cancel in the block
(:math:`A_u = cA`, :math:`G_u = G/c`), ``FAIL`` otherwise.  The block error is computed
without forming the Kronecker product: with :math:`A_u = \alpha A + E_A`,
:math:`G_u = \beta G + E_G` (:math:`E_A \perp A`, :math:`E_G \perp G` in the Frobenius inner
product) the four terms of :math:`A_u\otimes G_u - A\otimes G` are mutually orthogonal, so

.. math::

    \frac{\|A_u\otimes G_u - A\otimes G\|_F^2}{\|A\|_F^2\|G\|_F^2}
    = (\alpha\beta - 1)^2 + \alpha^2\frac{\|E_G\|^2}{\|G\|^2}
      + \beta^2\frac{\|E_A\|^2}{\|A\|^2} + \frac{\|E_A\|^2\|E_G\|^2}{\|A\|^2\|G\|^2},

a sum of non-negative terms (no cancellation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ._diagnose import diagnose_factor, ema_value, state_candidates
from ._reference import _np

#: what a named structural pitfall means for a hand-written K-FAC (the diagnosis' words; other
#: ids use conformance.diagnosis.PITFALLS; powers of N, |T| and 2 are explained per factor)
HINTS = {
    "patch_order": "patch vector in the other order: (kh, kw, C_in) with C_in fastest "
                   "(TF/JAX HWC) against unfold's (C_in, kh, kw) with the channel slowest",
    "bias_position": "the bias's homogeneous coordinate at the other end of A",
    "empirical_fisher": "the empirical Fisher (gradient at the data label) where the "
                        "Fisher of the model's own predictive distribution is asked",
    "true_fisher": "the exact (true) Fisher where another estimate is asked",
    "dilation_ignored": "patches read without the convolution's dilation (adjacent pixels "
                        "instead of every d-th)",
    "padding_ignored": "patches read without the zero padding (only the valid locations)",
    "padding_split": "'same' padding split the other way (the extra row or column before "
                     "instead of after, or vice versa)",
    "stride_ignored": "patches read at every location instead of every s-th (the stride "
                      "ignored)",
}

#: verdict levels: the layer's block (the default) or each factor on its own
LEVELS = ("block", "factors")

#: own-model convention fields -> allowed values (``None``: a positive number) and meaning;
#: the names and meanings are those of :data:`conformance.conventions.FIELDS`
CONVENTION_FIELDS = {
    "bias_position": (("last", "first", "separate"),
                      "where A's homogeneous (bias) coordinate sits; 'separate': A has no "
                      "bias coordinate (weight and bias as separate blocks, the bias block "
                      "being G)"),
    "patch_order": (("chw", "hwc"), "order of a convolution patch vector (default: the "
                                    "model's own, unfold's 'chw' for torch, 'hwc' for JAX)"),
    "conv_style": (("expand", "kfc", "reduce", "hybrid"),
                   "weight-shared layers: 'expand' (default) A=Σāāᵀ/(N|T|), G=Σggᵀ/N; 'kfc' "
                   "G normalised by N|T| as well (Γ = G/|T|, block |T|·A⊗Γ: TF, kfac-jax); "
                   "'reduce' KFAC-reduce; 'hybrid' |T|×A of expand with G of reduce "
                   "(BackPACK)"),
    "curvature_of": (("mean", "sum"), "curvature of the mean (default) or the summed loss "
                                      "(G N times larger)"),
    "mse_variance": (None, "the squared-error loss's variance v: 1 (default) is ½‖f−y‖², 0.5 "
                           "is ‖f−y‖² (G × 1/v, empirical G × 1/v²)"),
    "empirical_fisher_scale": (("per_example", "kfac_jax"),
                               "the empirical Fisher's G with kfac-jax's extra 1/N"),
    "ema_init": (("zero", "first", "identity"),
                 "a moving average's start: 0 (then debiased or raw, see ema_style), the "
                 "first statistic, or the identity m₀ = I"),
    "ema_style": (("zero_debias", "raw"), "a zero-started average divided by 1 − δᵏ "
                                          "(default) or not"),
}
_DEFAULTS = {"bias_position": "last", "patch_order": None, "conv_style": "expand",
             "curvature_of": "mean", "mse_variance": 1.0,
             "empirical_fisher_scale": "per_example", "ema_init": "zero",
             "ema_style": "zero_debias"}


def declared_conventions(fn, conventions):
    """``conventions`` (a dict of :data:`CONVENTION_FIELDS`, or ``None``) validated, with the
    defaults filled in.  Fields that concern the preconditioner (``kron_order``,
    ``damping_per_factor``) are refused with the name of the check that takes them."""
    if conventions is None:
        conventions = {}
    if not isinstance(conventions, dict):
        raise TypeError(f"{fn}: conventions must be a dict of field -> value; got "
                        f"{type(conventions).__name__}.")
    out = dict(_DEFAULTS)
    for key, value in conventions.items():
        if key in ("kron_order", "damping_per_factor"):
            raise ValueError(f"{fn}: conventions[{key!r}] concerns the preconditioner, not "
                             "the factors: check_torch_preconditioner takes "
                             "'damping_per_factor' and names a swapped Kronecker order.")
        if key not in CONVENTION_FIELDS:
            raise ValueError(f"{fn}: conventions has no field {key!r}; the fields are "
                             f"{', '.join(CONVENTION_FIELDS)}.")
        allowed = CONVENTION_FIELDS[key][0]
        if allowed is None:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value) and value > 0
            if not ok:
                raise ValueError(f"{fn}: conventions[{key!r}] must be a positive number; "
                                 f"got {value!r}.")
            value = float(value)
        elif value not in allowed:
            raise ValueError(f"{fn}: conventions[{key!r}] must be one of {allowed}; got "
                             f"{value!r}.")
        out[key] = value
    return out


def resolve_sharing(fn, sharing, conv):
    """The reference's weight-sharing approximation: ``sharing`` and the declared
    ``conv_style`` must agree (``"reduce"`` is KFAC-reduce; every other style is computed
    from the expand statistics)."""
    want = "reduce" if conv["conv_style"] == "reduce" else "expand"
    if conv["conv_style"] != "expand" and sharing != want:
        raise ValueError(f"{fn}: sharing={sharing!r} contradicts conventions['conv_style']="
                         f"{conv['conv_style']!r}; leave sharing at its default.")
    return want if conv["conv_style"] != "expand" else sharing


def _eps(dtype_name):
    from ..model import EPS32, EPS64

    if dtype_name in (None, "float64"):
        return EPS64
    if dtype_name == "bfloat16":
        return 2.0 ** -8
    if dtype_name == "float16":
        return float(np.finfo(np.float16).eps)
    return EPS32


def verdict(check) -> str:
    """A check's verdict (``check`` has ``ok``, ``rel_err``, ``rtol``, ``diagnosis`` and
    ``explanation``): ok with its relative error, or FAIL with the diagnosis."""
    if check.ok:
        return f"ok (relative error {check.rel_err:.1e} <= {check.rtol:.1e})"
    return (f"FAIL relative error {check.rel_err:.3e} > {check.rtol:.1e}; "
            f"diagnosis: {check.diagnosis}: {check.explanation}")


@dataclass
class LayerCheck:
    """One factor of one layer: agreement with the reference, or the diagnosed pitfall.
    ``scaled`` is set when the factor differs but the layer's block is equivalent."""

    layer: str
    factor: str
    ok: bool
    rel_err: float
    rtol: float
    diagnosis: str = ""
    explanation: str = ""
    scaled: str = ""

    def line(self) -> str:
        head = f"{self.layer}.{self.factor}: "
        if self.scaled and not self.ok:
            return head + f"differs by {self.scaled} (an equivalent split; see the block)"
        return head + verdict(self)


@dataclass
class BlockCheck:
    """One layer's block: the user's A ⊗ G against the reference's (``verdict`` ``"ok"``,
    ``"equivalent"`` — scalars that cancel, named in ``split`` — or ``"FAIL"``)."""

    layer: str
    verdict: str
    rel_err: float
    rtol: float
    split: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict in ("ok", "equivalent")

    def line(self) -> str:
        rel = f"relative error {self.rel_err:.1e}"
        if self.verdict == "ok":
            return f"{self.layer}: block ok ({rel} <= {self.rtol:.1e})"
        if self.verdict == "equivalent":
            return (f"{self.layer}: block equivalent ({rel} <= {self.rtol:.1e}): {self.split}"
                    f" cancel in A ⊗ G")
        return f"{self.layer}: block FAIL ({rel} > {self.rtol:.1e})"


def _wrap(line, width):
    """``line`` wrapped at ``width`` characters, continuation lines indented past its own
    indentation (a diagnosis stays readable in a terminal and on a docs page)."""
    import textwrap

    if not width or len(line) <= width:
        return line
    indent = " " * (len(line) - len(line.lstrip()) + 4)
    return "\n".join(textwrap.wrap(line, width, subsequent_indent=indent,
                                    break_long_words=False, break_on_hyphens=False))


@dataclass
class ModelCheck:
    """Every :class:`LayerCheck` (``checks``) and :class:`BlockCheck` (``blocks``) of a
    model.  ``ok``: every block agrees or is equivalent (``level="block"``), or every factor
    agrees (``level="factors"``), and nothing that should have been checked is missing
    (``unchecked``)."""

    mode: str
    checks: list = field(default_factory=list)
    blocks: list = field(default_factory=list)
    level: str = "block"
    unchecked: list = field(default_factory=list)
    declared: dict = field(default_factory=dict)
    #: ``str()`` wraps lines at this many characters (``0``: no wrapping): a terminal's 100
    #: columns and a docs page's code block
    width: int = 90
    #: layer -> what it is (``"dense, |T| = 5"``), for :meth:`table`
    kinds: dict = field(default_factory=dict)

    def table(self) -> str:
        """One row per checked layer: its kind, the block verdict, each factor's verdict and
        the diagnoses (the words are in ``str(result)``)."""
        blocks = {b.layer: b for b in self.blocks}
        rows, order = {}, []
        for c in self.checks:
            if c.layer not in rows:
                order.append(c.layer)
                b = blocks.get(c.layer)
                rows[c.layer] = {"layer": c.layer or "(model)",
                                 "kind": self.kinds.get(c.layer, ""),
                                 "block": b.verdict if b else "-", "A": "", "G / F": "",
                                 "diagnosis": []}
            row = rows[c.layer]
            col = "A" if c.factor == "A" else "G / F"
            row[col] = "ok" if c.ok else ("scaled" if c.scaled else "FAIL")
            if not c.ok and not c.scaled:
                row["diagnosis"].append(f"{c.factor}: {c.diagnosis}")
        cols = ["layer", "kind", "block", "A", "G / F", "diagnosis"]
        table = [cols] + [[rows[k][c] if c != "diagnosis" else "; ".join(rows[k][c])
                           for c in cols] for k in order]
        for name in self.unchecked:
            table.append([name, "", "NOT CHECKED", "", "", "no factors given"])
        widths = [max(len(r[i]) for r in table) for i in range(len(cols) - 1)]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths + [0],
                                                                     strict=True)).rstrip()
                         for r in table)

    @property
    def ok(self) -> bool:
        if self.unchecked or not self.checks:
            return False
        if self.level == "factors":
            return all(c.ok for c in self.checks)
        by_layer = {b.layer: b for b in self.blocks}
        return all(by_layer[c.layer].ok if c.layer in by_layer else c.ok
                   for c in self.checks)

    def __str__(self) -> str:
        verdict = "all agree" if self.ok else "DISAGREE"
        head = f"K-FAC factors against the reference (mode {self.mode}"
        if self.level != "block":
            head += f", level {self.level}"
        lines = [f"{head}): {verdict}"]
        if self.declared:
            lines.append("  under declared conventions: " + ", ".join(
                f"{k}={v!r}" for k, v in self.declared.items()))
        blocks = {b.layer: b for b in self.blocks}
        seen = set()
        for c in self.checks:
            if c.layer in blocks and c.layer not in seen:
                seen.add(c.layer)
                lines.append("  " + blocks[c.layer].line())
            lines.append(("    " if c.layer in blocks else "  ") + c.line())
        if self.unchecked:
            lines.append("  NOT CHECKED (no factors given; pass layers= to check a subset): "
                         + ", ".join(self.unchecked))
        return "\n".join(_wrap(line, self.width) for line in lines)


def positions(r):
    """|T| of a reference entry: its locations (or shared positions) per call times the
    number of calls (``uses``) — the positions its weight is shared over."""
    return r["T"] * r.get("uses", 1)


def _kind_text(r):
    text = r.get("kind", "")
    if r.get("groups", 1) > 1:
        text += f" ×{r['groups']} groups"
    if r["T"] > 1:
        text += f", |T| = {r['T']}"
    if r.get("uses", 1) > 1:
        text += f", {r['uses']} uses"
    return text


def _geometry_alternatives(ref):
    """The conv input factor with the dilation, the padding, the padding's split or the
    stride ignored (``ref`` carries the layer's data as ``_x``/``_g``), in ``ref``'s layout."""
    from ._reference import conv_reference_factors

    out = {}
    x, g = ref.get("_x"), ref.get("_g")
    if x is None or g is None or ref.get("kind") != "conv2d":
        return out
    geo = dict(kernel=tuple(ref["kernel"]), padding=ref["padding"],
               strides=tuple(ref["strides"]), dilation=tuple(ref["dilation"]))
    pads = tuple(tuple(p) for p in geo["padding"])
    variants = {}
    if any(d != 1 for d in geo["dilation"]):
        variants["dilation_ignored"] = dict(geo, dilation=(1, 1))
    if any(p for pair in pads for p in pair):
        variants["padding_ignored"] = dict(geo, padding=((0, 0), (0, 0)))
        if any(lo != hi for lo, hi in pads):
            variants["padding_split"] = dict(geo, padding=tuple((hi, lo) for lo, hi in pads))
    if any(s != 1 for s in geo["strides"]):
        variants["stride_ignored"] = dict(geo, strides=(1, 1))
    fmt = "NHWC" if ref.get("order") == "hwc" else "NCHW"
    for pid, kw in variants.items():
        try:
            a, _, _ = conv_reference_factors(x, g, bias=ref.get("bias", True),
                                             data_format=fmt, order=ref.get("order", "chw"),
                                             **kw)
        except ValueError:  # e.g. no output location without the padding
            continue
        out[pid] = a
    return out


def layer_alternatives(name, ref, others, mode, sharing):
    """What each pitfall would give for layer ``name``: ``{"A": {pitfall: array}, "G": ...}``.

    ``ref`` is the layer's reference entry, ``others`` maps ``"empirical_fisher"``,
    ``"true_fisher"`` and ``"sharing"`` to whole-model references computed the other way
    (any may be missing).  A conv layer adds the other patch order, alone and with the bias
    first, and, when its entry carries its data (``_x``, ``_g``), the input factor with the
    dilation, the padding (or its split) or the stride ignored."""
    alts = {"A": {}, "G": {}}
    a = ref.get("A")
    if a is None:  # a layer without Kronecker factors (scale-and-shift): its F
        alts["F"] = {key: others[key][name]["F"] for key in ("empirical_fisher", "true_fisher")
                     if key in others}
        return alts
    bias = ref.get("bias", True)
    if bias and a.shape[-1] > 1:
        alts["A"]["bias_position"] = _other_bias_end(a, "last")  # homogeneous coordinate first
    if ref.get("kind") in _CONV_KINDS and ref.get("kernel") is not None:
        order = ref.get("order", "chw")
        other_order = "hwc" if order == "chw" else "chw"
        other = _permute(a, _patch_perm(ref, a.shape[-1], order, other_order,
                                        True if bias else None))  # the other patch order
        if not np.allclose(other, a, rtol=1e-12, atol=0):
            alts["A"]["patch_order"] = other
            if bias:
                alts["A"]["patch_order+bias_position"] = _other_bias_end(other, "last")
    for key in ("empirical_fisher", "true_fisher"):
        if key in others:
            alts["G"][key] = others[key][name]["G"]
    other_sh = others.get("sharing")
    if other_sh is not None and positions(ref) > 1:
        key = f"{'reduce' if sharing == 'expand' else 'expand'}_instead_of_{sharing}"
        alts["A"][key] = other_sh[name]["A"]
        alts["G"][key] = other_sh[name]["G"]
    alts["A"].update(_geometry_alternatives(ref))
    return alts



# -- conventions: the reference moved into the declared layout and scale -------------------
_CONV_KINDS = ("conv1d", "conv2d", "conv3d")


def _permute(arr, idx):
    return arr[..., idx, :][..., :, idx]


def _patch_perm(r, d, src, dst, bias_last):
    """Index map taking a conv A of size ``d`` from patch order ``src`` to ``dst``."""
    from ..conventions import patch_index

    core = d - 1 if bias_last is not None else d
    kernel = list(r["kernel"])
    c = core // int(np.prod(kernel))
    i_src, i_dst = patch_index(kernel, c, src), patch_index(kernel, c, dst)
    idx = np.argsort(i_src)[i_dst]
    if bias_last is None:
        return idx
    return np.r_[idx, core] if bias_last else np.r_[core, idx + 1]


def _other_bias_end(arr, bias_pos):
    p = arr.shape[-1]
    perm = np.r_[p - 1, 0:p - 1] if bias_pos == "last" else np.r_[1:p, 0]
    return _permute(arr, perm)


def _declare_a(arr, r, conv):
    """The canonical (model-layout) A of entry ``r`` in the declared conventions."""
    if conv["conv_style"] == "hybrid" and positions(r) > 1:
        arr = arr * positions(r)
    order = r.get("order")
    if r.get("kind") in _CONV_KINDS and conv["patch_order"] not in (None, order):
        arr = _permute(arr, _patch_perm(r, arr.shape[-1], order, conv["patch_order"],
                                        True if r.get("bias", True) else None))
    if r.get("bias", True):
        if conv["bias_position"] == "first":
            arr = _other_bias_end(arr, "last")
        elif conv["bias_position"] == "separate":
            arr = arr[..., :-1, :-1]
    return arr


def _declare_g(arr, r, conv, mode, loss):
    """The canonical G (or a scale-and-shift F) of entry ``r`` in the declared scale."""
    if conv["conv_style"] == "kfc" and positions(r) > 1 and r.get("kind") != "scale_shift":
        arr = arr / positions(r)
    if conv["curvature_of"] == "sum":
        arr = arr * r["N"]
    if conv["empirical_fisher_scale"] == "kfac_jax" and mode == "fisher_empirical":
        arr = arr / r["N"]
    v = conv["mse_variance"]
    if loss == "mse" and v != 1.0:
        arr = arr / (v * v if mode == "fisher_empirical" else v)
    return arr


def _declared(fac, arr, r, conv, mode, loss):
    return _declare_a(arr, r, conv) if fac == "A" else _declare_g(arr, r, conv, mode, loss)


def _average(hist, conv, decay):
    """The declared moving average of the per-batch statistics ``hist`` (oldest first)."""
    if len(hist) == 1 and conv["ema_init"] != "identity" and conv["ema_style"] != "raw":
        return hist[0]
    start = conv["ema_init"]
    debias = conv["ema_style"] == "zero_debias" and start == "zero"
    return ema_value(hist, decay, start, debias=debias)


def _kron_rel_err(au, gu, a, g):
    """(relative error of A_u ⊗ G_u against A ⊗ G, α) by the orthogonal decomposition of
    the module docstring; a leading group axis sums over the groups' blocks."""
    au, gu, a, g = (np.reshape(m, (-1, *m.shape[-2:])) for m in (au, gu, a, g))
    num = den = 0.0
    alphas = []
    for au_j, gu_j, a_j, g_j in zip(au, gu, a, g, strict=True):
        na, ng = float(np.vdot(a_j, a_j)), float(np.vdot(g_j, g_j))
        if na == 0 or ng == 0:
            num += float(np.vdot(au_j, au_j)) * float(np.vdot(gu_j, gu_j))
            continue
        alpha, beta = float(np.vdot(a_j, au_j)) / na, float(np.vdot(g_j, gu_j)) / ng
        ea = float(np.linalg.norm(au_j - alpha * a_j)) ** 2
        eg = float(np.linalg.norm(gu_j - beta * g_j)) ** 2
        num += ((alpha * beta - 1) ** 2 * na * ng + alpha ** 2 * na * eg + beta ** 2 * ea * ng
                + ea * eg)
        den += na * ng
        alphas.append(alpha)
    rel = math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)
    return rel, (alphas[0] if alphas else 1.0)


def _split_text(alpha, n, t):
    """'A × 1/|T| = 1/25, G × |T| = 25' for the scalar α of an equivalent split."""
    from ._diagnose import _scale_label, _scales

    for _, _, a, b, e, v in _scales(n, t):
        if abs(v / alpha - 1) <= 1e-6 and (a, b, e) != (0, 0, 0):
            return (f"A × {_scale_label(a, b, e, n, t)}, "
                    f"G × {_scale_label(-a, -b, -e, n, t)}")
    return f"A × {alpha:.6g}, G × {1 / alpha:.6g}"


def _user_array(fn, name, fac, value):
    x = _np(value)
    if x.dtype.kind != "f":
        raise TypeError(f"{fn}: factors[{name!r}][{fac!r}] must be a real floating array; "
                        f"got dtype {x.dtype}.")
    return np.array(x, copy=True)


def copy_factors(fn, factors):
    """The user's factors as NumPy copies (``{layer: {key: array}}``), taken before anything
    else runs, so the check's own forward passes cannot change them."""
    if not isinstance(factors, dict) or not factors:
        raise ValueError(f"{fn}: factors must be a non-empty dict of layer name -> "
                         f"{{'A': ..., 'G': ...}}; got {factors!r:.80}.")
    out = {}
    for name, user in factors.items():
        if not isinstance(user, dict) or not set(user) <= {"A", "G", "F",
                                                                       "diag"}:
            raise ValueError(f"{fn}: factors[{name!r}] must be a dict with keys 'A' and/or "
                             f"'G' ('F' or 'diag' for a scale-and-shift layer); got "
                             f"{user!r:.80}.")
        out[name] = {fac: _user_array(fn, name, fac, v) for fac, v in user.items()}
    return out


def _selection(fn, ref, factors, layers):
    """{layer: factor keys to check}, and the list of what is missing."""
    def keys_of(r):
        return ("F",) if r.get("kind") == "scale_shift" else ("A", "G")

    if layers is None:
        want = {name: keys_of(r) for name, r in ref.items()}
    else:
        if isinstance(layers, str) or not all(isinstance(x, str) for x in layers):
            raise TypeError(f"{fn}: layers must be a list of layer names (or 'name.A', "
                            f"'name.G'); got {layers!r:.80}.")
        want = {}
        for item in layers:
            name, _, fac = item.rpartition(".") if item not in ref else (item, "", "")
            if item in ref:
                want[item] = keys_of(ref[item])
            elif name in ref and fac in keys_of(ref[name]):
                want[name] = tuple(sorted(set(want.get(name, ())) | {fac}))
            else:
                raise ValueError(f"{fn}: layers names {item!r}, which is not a supported "
                                 f"layer (or layer.factor) of the model ({', '.join(ref)}).")
    unknown = sorted(set(factors) - set(ref))
    if unknown:
        raise ValueError(f"{fn}: factors must name supported layers of the model "
                         f"({', '.join(ref)}); got {', '.join(map(str, unknown))}.")
    missing = []
    for name, keys in want.items():
        user = factors.get(name, {})
        if not user:
            missing.append(name)
            continue
        for fac in keys:
            have = fac in user or (fac == "F" and "diag" in user)
            if not have:
                missing.append(f"{name}.{fac}")
    return want, missing


def _plain(pid):
    """Plain words for a structural pitfall id (``a+b``: both)."""
    from ..diagnosis import PITFALLS

    return "; ".join(HINTS.get(p) or (PITFALLS[p][1] if p in PITFALLS else p)
                     for p in pid.split("+"))


def _history(batches, name, fac, pick, r, conv, mode, loss):
    """``pick(entry, alternatives)`` of layer ``name`` in every batch (oldest first), in the
    declared conventions (``None`` where a batch lacks it).  Under ``conv_style="hybrid"``
    G is the reduce statistic itself (the picked alternative)."""
    hybrid_g = fac == "G" and conv["conv_style"] == "hybrid" and positions(r) > 1
    out = []
    for ref_i, alts_i in batches:
        arr = pick(ref_i[name], alts_i[name].get(fac, {}))
        out.append(None if arr is None else
                   arr if hybrid_g else _declared(fac, arr, r, conv, mode, loss))
    return out


def _shape_diagnosis(x, fac, exp, r, conv, user, exp_other):
    """A user factor of another shape that looks like a known layout: (pitfall, text,
    compared array or None)."""
    if (fac == "A" and r.get("bias", True) and conv["bias_position"] != "separate"
            and x.shape == exp.shape[:-2] + (exp.shape[-2] - 1, exp.shape[-1] - 1)):
        core = exp[..., :-1, :-1] if conv["bias_position"] == "last" else exp[..., 1:, 1:]
        return ("bias_separate", "A has no bias coordinate (weight and bias kept as separate "
                "blocks?): compared with the reference's A without it; declare "
                "conventions={'bias_position': 'separate'} if that is your layout", core)
    other = user.get("G" if fac == "A" else "A")
    if (exp_other is not None and x.shape == exp_other.shape and other is not None
            and np.shape(other) == exp.shape):
        return ("factors_swapped", f"{fac} has the shape of {'G' if fac == 'A' else 'A'} "
                f"{exp_other.shape} and the other factor the shape of {fac}: A and G "
                "swapped", exp_other)
    return None


def check_factors(ref, factors, alternatives, mode, fn="check_factors", *, conventions=None,
                  level="block", layers=None, earlier=None, decay=None,
                  loss="cross_entropy") -> ModelCheck:
    r"""Compare ``factors`` (``{layer: {"A": ..., "G": ...}}``) with the reference ``ref``
    (as :func:`reference_torch_kfac` returns) per layer: each factor, and the layer's block
    :math:`A\otimes G` (module docstring), with the tolerance

    .. math::

        \frac{\|X_\text{user} - X\|_F}{\|X\|_F} \le \text{rtol}
        = 16\,(N|T|K + d)\,\varepsilon

    per factor (:math:`K = 1` for ``A``, :math:`d` the factor's size, :math:`\varepsilon`
    the unit roundoff of the coarser of the user's and the model's floating types) and
    :math:`\text{rtol}_A + \text{rtol}_G` for the block.  ``conventions`` (see
    :data:`CONVENTION_FIELDS`) move the reference into the user's declared layout and scale
    first.  ``earlier``: ``[(ref_i, alternatives_i), ...]`` of the batches of earlier
    updates, oldest first, averaged with ``decay`` as the declared ``ema_init`` /
    ``ema_style`` say.  ``layers``: the layers (or ``"layer.A"``) to check; by default
    every supported layer, and a layer or factor without user factors makes the result
    fail.  Each disagreement is diagnosed (:mod:`conformance.own_model._diagnose`) against
    ``alternatives`` (as :func:`layer_alternatives` returns, per layer)."""
    from ..compare import compare
    from ..model import SAFETY, Tolerance

    if level not in LEVELS:
        raise ValueError(f"{fn}: level must be one of {LEVELS}; got {level!r}.")
    conv = declared_conventions(fn, conventions)
    factors = copy_factors(fn, factors)
    want, missing = _selection(fn, ref, factors, layers)
    batches = list(earlier or []) + [(ref, alternatives)]
    needs_decay = len(batches) > 1 or conv["ema_init"] == "identity" or (
        conv["ema_style"] == "raw")
    if needs_decay and not (isinstance(decay, (int, float)) and 0 < decay < 1):
        raise ValueError(f"{fn}: decay must be the moving average's decay in (0, 1) when "
                         f"several batches are given or the average is declared started at "
                         f"the identity or raw; got {decay!r}.")
    declared = {k: v for k, v in conv.items() if v != _DEFAULTS[k]}
    result = ModelCheck(mode, level=level, unchecked=missing, declared=declared,
                        kinds={name: _kind_text(r) for name, r in ref.items()})
    for name, keys in want.items():
        user = factors.get(name, {})
        r = ref[name]
        n, t = r["N"], positions(r)
        expected, rtols = {}, {}
        for fac in keys:
            key = "diag" if fac == "F" and "diag" in user and "F" not in user else fac
            if key not in user:
                continue
            x = user[key]

            def hist_of(pick, fac=fac, r=r, name=name):
                return _history(batches, name, fac, pick, r, conv, mode, loss)

            if fac == "G" and conv["conv_style"] == "hybrid" and positions(r) > 1:
                hist = hist_of(lambda e, al: al.get("reduce_instead_of_expand"))
            else:
                hist = hist_of(lambda e, al, fac=fac: e[fac])
            exp = _average(hist, conv, decay)
            eps = max(_eps(str(x.dtype)), _eps(r.get("dtype")))
            rows = n * t * (r["K"] if fac != "A" else 1)
            tol = Tolerance(SAFETY * (rows + exp.shape[-1]),
                            "one sum of N·|T|·K outer products per entry, and the forward "
                            "and backward passes of the model")
            rtol = tol.rtol(eps)
            if key == "diag":
                exp = np.diagonal(exp, axis1=-2, axis2=-1)
            if fac == "A" and r.get("A_diagonal") and x.ndim == exp.ndim - 1:
                x = np.einsum("...i,ij->...ij", x, np.eye(x.shape[-1]))
            label = key
            if x.shape != exp.shape:
                other_fac = "G" if fac == "A" else "A"
                exp_other = None
                if other_fac in keys:
                    exp_other = _declared(other_fac, r[other_fac], r, conv, mode, loss)
                found = _shape_diagnosis(x, fac, exp, r, conv, user, exp_other)
                if found is None:
                    raise ValueError(f"{fn}: factors[{name!r}][{key!r}] must have shape "
                                     f"{exp.shape} (the model's layout under the declared "
                                     f"conventions); got {x.shape}.")
                pid, text, cmp_to = found
                c = compare(x.astype(np.float64), cmp_to, rtol)
                text += (f"; then it agrees (relative error {c.rel_err:.1e})" if c.ok else
                         f"; it still differs (relative error {c.rel_err:.1e})")
                result.checks.append(LayerCheck(name, label, False, c.rel_err, rtol, pid,
                                                text))
                continue
            xf = x.astype(np.float64)
            c = compare(xf, exp, rtol)
            check = LayerCheck(name, label, c.ok, c.rel_err, rtol)
            expected[fac], rtols[fac] = (xf, exp), rtol
            if not c.ok:
                bases = []
                for pid, _ in alternatives[name].get(fac, {}).items():
                    if pid.startswith("_"):
                        continue
                    arrs = hist_of(lambda e, al, pid=pid: al.get(pid))
                    if all(a is not None for a in arrs):
                        base = _average(arrs, conv, decay)
                        if key == "diag":
                            base = np.diagonal(base, axis1=-2, axis2=-1)
                        bases.append((pid, _plain(pid), base))
                if fac == "A" and r.get("bias", True) and conv["bias_position"] != "separate":
                    for pid, text, arr in list(bases) + [("", "", exp)]:
                        if "bias_position" in pid:
                            continue
                        moved = _other_bias_end(arr, conv["bias_position"])
                        bases.append(((pid + "+" if pid else "") + "bias_position",
                                      (text + "; " if text else "") + HINTS["bias_position"],
                                      moved))
                if key != "diag" and exp.ndim == 2 and exp.shape[0] == exp.shape[1]:
                    bases += [(pid, text, arr) for pid, text, arr in state_candidates(
                        xf, hist if key == fac else [np.diagonal(h) for h in hist], decay)]
                bases.append(("negated", "equals −expected", -exp))
                d = diagnose_factor(xf, exp, bases, factor=fac, n=n, t=t, rtol=rtol,
                                    loss=loss)
                check.diagnosis = d.pitfall
                check.explanation = d.explanation
                if d.pitfall == "unexplained" and fac == "G" and mode != "fisher_sampled" \
                        and c.rel_err < 1:
                    check.explanation += (
                        "; if your G is a Monte Carlo estimate (labels sampled from the "
                        "model), pass mode='fisher_sampled' with your draws as samples= "
                        "(or rng=)")
            result.checks.append(check)
        if "A" in expected and "G" in expected:
            (au, a), (gu, g) = expected["A"], expected["G"]
            rel, alpha = _kron_rel_err(au, gu, a, g)
            btol = rtols["A"] + rtols["G"]
            factor_ok = all(c.ok for c in result.checks if c.layer == name)
            if factor_ok:
                verdict, split = "ok", ""
            elif rel <= btol:
                verdict, split = "equivalent", _split_text(alpha, n, t)
                for c in result.checks:
                    if c.layer == name and not c.ok:
                        c.scaled = split.split(", ")[0 if c.factor == "A" else 1][4:]
            else:
                verdict, split = "FAIL", ""
            result.blocks.append(BlockCheck(name, verdict, rel, btol, split))
    return result


def check_batches(fn, factors, batches, mode, *, reference, outputs, loss, sharing, rng,
                  samples, mc_samples, conventions, level, layers, decay) -> ModelCheck:
    """The own-model check of ``factors`` against the statistics of ``batches`` (the
    ``(inputs, targets)`` of every update, oldest first): the one driver of the torch and
    JAX routes.  ``reference(inputs, targets, mode, sharing, samples)`` computes a batch's
    reference entries; ``outputs(inputs)`` the model's float64 outputs (for drawing the
    samples of ``mode="fisher_sampled"`` from ``rng``, batch by batch).  Each batch also
    gets its alternatives: the other estimate (empirical or true Fisher) and, where a weight
    is shared, the other sharing approximation."""
    from ._reference import as_rng, sample_targets

    factors = copy_factors(fn, factors)  # before any forward pass can fire the user's hooks
    sharing = resolve_sharing(fn, sharing, declared_conventions(fn, conventions))
    if not all(isinstance(b, (list, tuple)) and len(b) == 2 for b in batches):
        raise TypeError(f"{fn}: earlier must be a list of (inputs, targets) pairs; got "
                        f"{batches[:-1]!r:.80}.")
    if len(batches) > 1 and samples is not None:
        raise ValueError(f"{fn}: with earlier batches, give rng (draws for every batch), "
                         "not samples.")
    gen = as_rng(fn, rng) if rng is not None else None
    history = []
    for x_i, y_i in batches:
        s_i = samples
        if mode == "fisher_sampled" and samples is None:  # one set of draws per batch
            s_i = sample_targets(loss, outputs(x_i), gen, mc_samples)
        ref = reference(x_i, y_i, mode, sharing, s_i)
        others = {}
        if mode != "fisher_empirical":
            others["empirical_fisher"] = reference(x_i, y_i, "fisher_empirical", sharing, None)
        if mode != "fisher_exact":
            others["true_fisher"] = reference(x_i, y_i, "fisher_exact", sharing, None)
        if any(positions(r) > 1 for r in ref.values()):
            others["sharing"] = reference(x_i, y_i, mode,
                                          "reduce" if sharing == "expand" else "expand", s_i)
        history.append((ref, {name: layer_alternatives(name, ref[name], others, mode,
                                                       sharing) for name in ref}))
    ref, alts = history[-1]
    return check_factors(ref, factors, alts, mode, fn, conventions=conventions, level=level,
                         layers=layers, earlier=history[:-1], decay=decay, loss=loss)
