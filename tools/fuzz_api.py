"""Argument fuzzer of kfac_ref's public API: every array argument, corrupted one at a time.

The corpus is ``tests/api_calls.py``: for each public object a valid call written as
``lambda f: ...`` whose array arguments are all made by ``f`` from host NumPy data.  The
fuzzer runs each call once with ``f = numpy.asarray`` and counts the ``k`` calls of ``f``;
then, for each ``i < k`` and each corruption that applies to the ``i``-th array, it reruns
the call with only that array corrupted and classes the outcome:

``clear``
    a kfac_ref error (:class:`kfac_ref.KFACInputError`) whose message names the function,
    an argument and what was given (``"<func>: <arg> must ...; got ..."`` or the namespace,
    device and precision forms of :func:`kfac_ref._backend.namespace_of`);
``unclear``
    any other exception, or a kfac_ref error that names no argument;
``silent``
    returned although the corruption must be refused (NaN or Inf planted, a precision or
    namespace mix, an integer, boolean, complex or non-array argument), or returned
    non-finite numbers, or — for a lone array on array-api-strict — numbers that differ
    from NumPy's;
``accepted``
    returned, and that is legitimate: a lone array in another namespace or precision
    (the result keeps that namespace or precision and, on array-api-strict, NumPy's
    numbers), a shape corruption with finite results, or a case of the explicit
    allow-list ``ALLOWED`` below (each with its reason).

An array that a user callable closes over (the matrix of a ``matvec``; ``_closed`` in the
corpus) is not an argument and is never corrupted; what the callable returns is checked by
the function that calls it.  A strict array carries a mark (its values times 1 + 2⁻²⁰) so
that a NumPy result computed from it is seen as a namespace mix.  The public objects that
take no arrays (``kfac_ref.capabilities``, option registries) have nothing to corrupt.

With ``--value-checks-off`` the fuzzer checks the policy for values that are not checked
instead (:func:`kfac_ref.value_checks` off, as for traced and lazy arrays): a NaN planted in
each floating array, one at a time, must give a result, never an exception (``unclear``:
a library's own error, or a value check that did not switch off).  A result with NaN is
``clear``; a finite one is ``accepted`` (the array may not reach every output: targets of
a GGN, the last bias of a Gauss-Newton matrix; the fuzzer cannot tell).

Run::

    python tools/fuzz_api.py                 # table of counts; the non-clear cases
    python tools/fuzz_api.py --value-checks-off   # the policy for unchecked values
    python tools/fuzz_api.py --json out.json # every case, machine readable
    python tools/fuzz_api.py --only kfac_ref.linalg   # entries whose name starts so
    python tools/fuzz_api.py --max-indices 16  # at most 16 arrays per call (the test's part)

Exit status 1 when an ``unclear`` or ``silent`` case remains.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (_ROOT, os.path.join(_ROOT, "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import array_api_strict  # noqa: E402

_STRICT = type(array_api_strict.asarray(0.0))

from kfac_ref import KFACInputError  # noqa: E402

CLASSES = ("clear", "unclear", "silent", "accepted")


# --------------------------------------------------------------------------------------
# Corruptions: (applies to this host array?, the corrupted argument, what must happen)
# --------------------------------------------------------------------------------------
def _floating(a):
    return a.dtype.kind == "f"


def _plant(value):
    def make(a):
        b = np.array(a, dtype=a.dtype, copy=True)
        b.reshape(-1)[b.size // 2] = value
        return b
    return make


# "refuse": returning is silent; "alone": a lone array may be accepted (kept namespace or
# precision), next to others it must be refused; "shape": returning finite numbers is
# accepted.
CORRUPTIONS = {
    "nan": (lambda a: _floating(a) and a.size > 0, _plant(np.nan), "refuse"),
    "inf": (lambda a: _floating(a) and a.size > 0, _plant(np.inf), "refuse"),
    "float32": (lambda a: a.dtype == np.float64, lambda a: a.astype(np.float32), "alone"),
    "int64": (_floating, lambda a: a.astype(np.int64), "refuse"),
    "bool": (lambda a: a.dtype != np.bool_, lambda a: a != 0, "refuse"),
    "complex": (lambda a: True, lambda a: a.astype(np.complex128), "refuse"),
    "list": (lambda a: a.ndim > 0, lambda a: a.tolist(), "refuse"),
    "strict": (lambda a: True, lambda a: array_api_strict.asarray(a), "alone"),
    "0-d": (lambda a: a.ndim > 0 and a.size > 0, lambda a: np.asarray(a.reshape(-1)[0]),
            "shape"),
    "extra-axis": (lambda a: True, lambda a: a[None], "shape"),
    "empty-axis": (lambda a: a.ndim > 0 and a.shape[0] > 0, lambda a: a[:0], "shape"),
}

# --------------------------------------------------------------------------------------
# The allow-list: (entry, index of the array, corruption) -> why returning is right.
# Never a blanket entry: each names one array of one call.
# --------------------------------------------------------------------------------------
_MOVES = ("nan", "inf", "int64", "bool", "complex")


def _allow(entry, index, corruptions, reason):
    return {(entry, index, c): reason for c in corruptions}


ALLOWED: dict[tuple[str, int, str], str] = {
    # layout moves and row selection: entries are moved, never computed with, so any dtype
    # and any value is data (documented: dtype=None, finite=False)
    **_allow("kfac_ref.conv_geometry.to_channels_last", 0, _MOVES,
             "a layout transpose moves entries of any dtype and value"),
    **_allow("kfac_ref.conv_geometry.from_channels_last", 0, _MOVES,
             "a layout transpose moves entries of any dtype and value"),
    **_allow("kfac_ref.conv_geometry.ConvGeometry", 0, _MOVES,
             "ConvGeometry.to_channels_last: a layout transpose of any dtype and value"),
    **_allow("kfac_ref.patches.subsample_rows", 0, _MOVES,
             "selects rows of an array of any dtype (documented), values untouched"),
    # read only for its library, device and dtype (documented "like" arguments)
    **_allow("kfac_ref.patches.temporary_bytes_bound", 0, (*_MOVES, "list"),
             "like is read only for where it lives (host data: the host bound)"),
    **_allow("kfac_ref.nn.Sequential", 8, ("nan", "inf"),
             "init_params' like array is read only for its namespace, device and dtype"),
    # targets handed to the user's own value/gradient/Hessian functions, which define them
    **_allow("kfac_ref.losses.CustomLoss", 1, ("int64", "bool"),
             "targets go to the user's callables, which define their dtype (labels)"),
    **_allow("kfac_ref.losses.CustomNegativeLogProbLoss", 1, ("int64", "bool"),
             "targets go to the user's callables, which define their dtype (labels)"),
    # documented: "One-hot rows: entries 0/1 (bool, integer or floating)"
    **_allow("kfac_ref.losses.OneHotCategoricalLogitsNegativeLogProbLoss", 1, ("int64", "bool"),
             "one-hot targets may be bool or integer 0/1 rows (documented)"),
    # documented: "values in [0, 1] (bool, integer or floating; soft labels)"
    **_allow("kfac_ref.losses.MultiBernoulliNegativeLogProbLoss", 1, ("int64", "bool"),
             "Bernoulli targets may be bool or integer 0/1 (documented)"),
    # the matmat's own failure on a probe block it cannot multiply is the user's error
    ("kfac_ref.spectral.hutchinson_trace", 0, "empty-axis"):
        "a [0, m] probe block: d is known only to the user's matmat, whose error it raises",
}


@dataclass
class Case:
    entry: str
    index: int
    corruption: str
    cls: str
    detail: str


class _Counter:
    """The ``f`` of a corpus call: host data to NumPy, the ``index``-th one corrupted."""

    def __init__(self, index=-1, corrupt=None):
        self.k, self.hosts, self.index, self.corrupt = 0, [], index, corrupt

    def __call__(self, host):
        a = np.asarray(host)
        i = self.k
        self.k += 1
        self.hosts.append(a)
        return self.corrupt(a) if i == self.index else a

    @staticmethod
    def closed(host):
        """An array a user callable closes over (not an argument): never corrupted."""
        return np.asarray(host)


def _leaves(result):
    out = []
    stack = [result]
    while stack:
        r = stack.pop()
        if isinstance(r, (tuple, list)):
            stack.extend(reversed(r))
        elif isinstance(r, dict):
            stack.extend(reversed(list(r.values())))
        else:
            out.append(r)
    return out


def _host(leaf):
    """A leaf as a float64/complex NumPy array, or None when it is not numeric."""
    if isinstance(leaf, bool):
        return None
    if isinstance(leaf, (int, float, complex, np.number)):
        return np.asarray(leaf)
    if isinstance(leaf, _STRICT):
        return np.asarray(leaf)
    if isinstance(leaf, np.ndarray) and leaf.dtype.kind in "fciub":
        return leaf
    return None


_NAMED = re.compile(
    r"^([\w.\[\]]+(\([^)]*\))?: )+"  # the function or method (and the one it called)
    r"(.*\bmust\b.*\bgot\b"  # "<arg> must be ...; got ..."
    r"|all arrays must (come from one array namespace|live on one device)"
    r"|.*must have the floating dtype of)", re.S)


def _classify_error(exc):
    if isinstance(exc, KFACInputError) and _NAMED.search(str(exc)):
        return "clear", f"{type(exc).__name__}: {exc}"
    return "unclear", f"{type(exc).__name__}: {exc}"


def _run(call, f):
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        with np.errstate(all="ignore"):
            return call(f)


def _finite(hosts):
    return all(h is None or h.dtype.kind not in "fc" or bool(np.all(np.isfinite(h)))
               for h in hosts)


def _close(got, expected, rtol):
    if len(got) != len(expected):
        return False
    for g, e in zip(got, expected, strict=True):
        if (g is None) != (e is None):
            return False
        if g is None:
            continue
        g, e = np.asarray(g), np.asarray(e)
        if g.shape != e.shape:
            return False
        scale = float(np.max(np.abs(e))) if e.size else 0.0
        if e.size and float(np.max(np.abs(g.astype(np.complex128) - e))) > rtol * max(
                scale, 1e-300):
            return False
    return True


def _judge_alone(cname, what, leaves, hosts, base_hosts, marked_hosts):
    """A lone array in another namespace (array-api-strict) or precision (float32) that was
    accepted.  Each result leaf either carries it (a strict array with the numbers of the
    same call on NumPy; a finite float32 array) or is unchanged from the reference run (a
    call of the corpus that did not see the corrupted array).  A NumPy/float64 leaf whose
    numbers moved saw the corrupted array mixed with the others: silent.  The strict array
    carries a mark (its values times 1 + 2⁻²⁰; ``marked_hosts`` is the NumPy run with that
    mark) so that a NumPy result computed from it cannot pass as unchanged."""
    if len(hosts) != len(base_hosts):
        return "silent", f"{what}: returned a different number of results"
    for leaf, h, e, m in zip(leaves, hosts, base_hosts, marked_hosts, strict=True):
        if h is None or e is None:
            continue
        carried = (isinstance(leaf, _STRICT) if cname == "strict"
                   else getattr(leaf, "dtype", None) == np.float32)
        if carried and cname == "strict" and not _close([h], [m], 1e-9):
            return "silent", f"{what}: numbers differ from NumPy's"
        if carried and not _finite([h]):
            return "silent", f"{what}: returned NaN/Inf"
        if not carried and not _close([h], [e], 1e-12):
            kind = "namespace" if cname == "strict" else "precision"
            return "silent", f"{what}: {kind} mix returned ({type(leaf).__name__} " \
                f"{getattr(leaf, 'dtype', '')} result moved)"
    return "accepted", f"{what}: lone array, kept or unchanged"


_MARK = 1.0 + 2.0 ** -20


def _marked(call, i, base_hosts):
    """The strict corruption of array ``i`` with its values marked (times 1 + 2⁻²⁰), and
    the NumPy results of the call with the same mark; unmarked when the marked call fails
    (a mark can break a contract such as one-hot rows)."""
    try:
        marked = _run(call, _Counter(i, lambda a: a * _MARK))
    except Exception:  # noqa: BLE001
        return CORRUPTIONS["strict"][1], base_hosts
    hosts = [_host(x) for x in _leaves(marked)]
    if len(hosts) != len(base_hosts):
        return CORRUPTIONS["strict"][1], base_hosts
    return (lambda a: array_api_strict.asarray(a * _MARK)), hosts


def _spread(k, most):
    """``most`` indices of ``range(k)`` spread evenly, first and last included (all of them
    when ``most`` is None or at least ``k``)."""
    if most is None or most >= k:
        return list(range(k))
    return sorted({round(j * (k - 1) / (most - 1)) for j in range(most)}) if most > 1 else [0]


def fuzz_entry(name, call, corruptions=CORRUPTIONS, allowed=ALLOWED, max_indices=None):
    """Every case of one corpus entry: a list of :class:`Case` (``max_indices`` arrays of
    the call at most, spread evenly over them, when given)."""
    base_f = _Counter()
    base = _run(call, base_f)
    base_leaves = _leaves(base)
    base_hosts = [_host(x) for x in base_leaves]
    cases = []
    for i in _spread(len(base_f.hosts), max_indices):
        a = base_f.hosts[i]
        for cname, (applies, make, rule) in corruptions.items():
            if not applies(a):
                continue
            marked_hosts = base_hosts
            if cname == "strict" and _floating(a):
                make, marked_hosts = _marked(call, i, base_hosts)
            f = _Counter(i, make)
            try:
                out = _run(call, f)
            except Exception as exc:  # noqa: BLE001  (every exception is classed)
                cls, detail = _classify_error(exc)
                if cls != "clear" and (name, i, cname) in allowed:
                    cls, detail = "accepted", f"allowed: {allowed[name, i, cname]} ({detail})"
                cases.append(Case(name, i, cname, cls, detail))
                continue
            leaves = _leaves(out)
            hosts = [_host(x) for x in leaves]
            if (name, i, cname) in allowed:
                cases.append(Case(name, i, cname, "accepted",
                                  "allowed: " + allowed[name, i, cname]))
                continue
            what = f"array {i} ({a.dtype}{list(a.shape)}) {cname}"
            if not _finite(hosts) and _finite(base_hosts):
                cases.append(Case(name, i, cname, "silent", f"{what}: returned NaN/Inf"))
            elif rule == "refuse":
                cases.append(Case(name, i, cname, "silent", f"{what}: returned"))
            elif rule == "shape":
                cases.append(Case(name, i, cname, "accepted", f"{what}: finite result"))
            else:  # "strict" or "float32": the arrays it reached keep it, the others agree
                cases.append(Case(name, i, cname, *_judge_alone(cname, what, leaves, hosts,
                                                                base_hosts, marked_hosts)))
    return cases


def policy_entry(name, call, max_indices=None):
    """The value-checks-off cases of one corpus entry: a NaN planted in each floating array
    (at most ``max_indices`` of them, spread evenly), the call run with value checks off."""
    import kfac_ref

    base_f = _Counter()
    _run(call, base_f)
    cases = []
    for i in _spread(len(base_f.hosts), max_indices):
        a = base_f.hosts[i]
        applies, make, _ = CORRUPTIONS["nan"]
        if not applies(a):
            continue
        what = f"array {i} ({a.dtype}{list(a.shape)}) nan, value checks off"
        try:
            with kfac_ref.value_checks(False):
                out = _run(call, _Counter(i, make))
        except Exception as exc:  # noqa: BLE001  (every exception breaks the policy)
            cases.append(Case(name, i, "nan-unchecked", "unclear",
                              f"{what}: {type(exc).__name__}: {exc}"))
            continue
        if _finite([_host(x) for x in _leaves(out)]):
            cases.append(Case(name, i, "nan-unchecked", "accepted",
                              f"{what}: finite result (not judged)"))
        else:
            cases.append(Case(name, i, "nan-unchecked", "clear", f"{what}: NaN out"))
    return cases


def corpus():
    """The corpus: name -> call (DASK_CALLS and NUMPY_CALLS of tests/api_calls.py)."""
    import api_calls

    return {**api_calls.DASK_CALLS, **api_calls.NUMPY_CALLS}


# Entries left out, each with its reason (none at present).
SKIPPED: dict[str, str] = {}


def fuzz(names=None, progress=None, max_indices=None, value_checks_off=False):
    calls = corpus()
    cases = []
    for name in sorted(calls) if names is None else names:
        if name in SKIPPED:
            continue
        t0 = time.perf_counter()
        if value_checks_off:
            cases += policy_entry(name, calls[name], max_indices=max_indices)
        else:
            cases += fuzz_entry(name, calls[name], max_indices=max_indices)
        if progress:
            progress(name, time.perf_counter() - t0)
    return cases


def table(cases):
    counts = Counter(c.cls for c in cases)
    lines = [f"{'class':<10}{'cases':>7}"] + [f"{c:<10}{counts.get(c, 0):>7}" for c in CLASSES]
    bad = [c for c in cases if c.cls in ("unclear", "silent")]
    if bad:
        lines.append("")
        lines += [f"{c.cls:<8} {c.entry} [array {c.index}, {c.corruption}]: "
                  f"{c.detail[:300]}" for c in bad]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="PATH", help="write every case as JSON")
    ap.add_argument("--only", metavar="PREFIX", action="append",
                    help="entries whose name starts with PREFIX (repeatable)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each entry's time")
    ap.add_argument("--max-indices", type=int, metavar="M",
                    help="corrupt at most M arrays of each call, spread evenly (default all)")
    ap.add_argument("--value-checks-off", action="store_true",
                    help="check the policy for unchecked values instead (NaN planted, value "
                         "checks off: a result, never an exception)")
    args = ap.parse_args(argv)
    names = None
    if args.only:
        names = sorted(n for n in corpus() if any(n.startswith(p) for p in args.only))
    progress = (lambda n, t: print(f"{t:7.2f}s {n}", file=sys.stderr)) if args.verbose else None
    cases = fuzz(names, progress, args.max_indices, args.value_checks_off)
    print(table(cases))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump([asdict(c) for c in cases], fh, indent=1)
    return 1 if any(c.cls in ("unclear", "silent") for c in cases) else 0


if __name__ == "__main__":
    sys.exit(main())

