"""``python -m conformance new-adapter NAME``: a commented adapter skeleton to start from.

The skeleton is a complete, loadable adapter: every capability of the catalogue is listed in
``unsupported`` (so a first run reports every case as skipped, never as passed) with a
commented method stub saying what it receives and must return, and every convention field
is written out with its reference value and its meaning.  Implementing a capability means
writing its method and deleting its line from ``unsupported``.
"""

from __future__ import annotations

import keyword
import re
import textwrap

__all__ = ["adapter_skeleton", "check_name"]

_NAME = re.compile(r"[a-z][a-z0-9_]*")


def check_name(name: str) -> str:
    """``name`` if it is usable as an adapter name and module name (lower-case letters,
    digits and ``_``, starting with a letter, not a Python keyword); else ``ValueError``."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or keyword.iskeyword(name):
        raise ValueError("new-adapter: NAME must be lower-case letters, digits and _, "
                         f"starting with a letter (a Python identifier); got {name!r}.")
    return name


def _comment(text: str, indent: str, width: int = 96) -> str:
    return textwrap.fill(text, width=width, initial_indent=indent + "# ",
                         subsequent_indent=indent + "# ", break_on_hyphens=False,
                         break_long_words=False)


def adapter_skeleton(name: str) -> str:
    """The source of a skeleton adapter module for an implementation called ``name``."""
    from .adapters import ENTRY_POINT_GROUP
    from .catalogue import capabilities
    from .conventions import CANONICAL, FIELDS

    name = check_name(name)
    klass = "".join(p.capitalize() for p in name.split("_")) + "Adapter"
    caps = capabilities()
    out = [f'''"""Conformance adapter for {name}: checks its K-FAC quantities against kfac_ref.

Run it (from the directory that holds this file, or with the module importable):

    python -m conformance --adapter {name}_adapter.py       # this file
    python -m conformance --adapter mypkg.{name}_adapter    # as an importable module
    pytest --kfac-adapter=mypkg.{name}_adapter              # the catalogue as pytest items

To make it one of the adapters that `python -m conformance list` shows and that
`--all-adapters` runs, declare an entry point in your package's pyproject.toml:

    [project.entry-points."{ENTRY_POINT_GROUP}"]
    {name} = "mypkg.{name}_adapter:{klass}"

Protocol (conformance/README.md, "Writing an adapter"): a capability function receives
``inputs``, a dict of float64 NumPy arrays already converted into the conventions declared
below, and ``params``, a dict of Python scalars and strings; it returns anything
``numpy.asarray`` reads (NumPy, CPU torch tensors, JAX arrays).  Raise CaseUnsupported for
a single case the implementation cannot express (a loss it lacks), never for a wrong number.
"""

from __future__ import annotations

from conformance.adapter import (  # noqa: F401  (CaseUnsupported, implements: for the stubs)
    Adapter,
    AdapterUnavailable,
    CaseUnsupported,
    implements,
)
from conformance.conventions import Conventions

__all__ = ["{klass}", "ADAPTER"]


class {klass}(Adapter):
    name = "{name}"
    description = "{name} (describe the implementation and the API this adapter calls)"
    # the floating type the implementation computes in: "float64" or "float32" (the
    # tolerances scale with its unit roundoff)
    dtype = "float64"
    # extra relative error the implementation's hyper-parameter handling adds (e.g. a
    # damping passed through float32), with the reason; 0.0 when none
    hyperparameter_rtol = 0.0
    hyperparameter_rtol_reason = ""

    # Declared conventions: where the implementation differs from the reference.  The
    # suite converts the reference into these before comparing, and the report says which
    # declaration explained a difference.  Each value below is the reference's; change
    # the ones your implementation does differently.
    conventions = Conventions(''']
    for field, (allowed, meaning) in FIELDS.items():
        vals = " | ".join(repr(a) for a in allowed) if allowed else "None | a number"
        out.append(_comment(f"{field} ({vals}): {meaning}", " " * 8))
        out.append(f"        {field}={getattr(CANONICAL, field)!r},")
    out.append("    )")
    out.append("")
    out.append(_comment("Capabilities not implemented (yet): every case of these is skipped "
                        "with the reason, never passed.  Delete a line when its method is "
                        "written.", "    "))
    out.append("    unsupported = {")
    for cap in caps:
        out.append(f'        "{cap}": "not implemented in this adapter yet",')
    out.append("    }")
    out.append("")
    out.append(_comment("case-id or capability patterns (fnmatch) -> reason: single cases "
                        "the implementation cannot express", "    "))
    out.append("    skip_cases: dict = {}")
    out.append("")
    out.append(_comment("random capabilities (the sampling modes) whose draws the "
                        "implementation can take as inputs (sampled_targets, signs): compared "
                        "exactly; the others are called with params['seed'] and tested "
                        "statistically", "    "))
    out.append("    accepts_draws = ()")
    out.append(f'''
    def setup(self):
        """Import the implementation here (not at module level), so that listing adapters
        stays cheap and works where it is not installed."""
        try:
            import {name}  # noqa: F401  (replace with the implementation's import)
        except ImportError as exc:
            raise AdapterUnavailable(f"{name} is not installed: {{exc}}") from exc

    def version(self):
        import {name}

        return getattr({name}, "__version__", "")
''')
    for cap_name, cap in caps.items():
        meth = cap_name.replace(".", "_")
        out.append(_comment(f"{cap_name}: {cap.summary}", "    "))
        out.append(_comment(f"receives {cap.signature}", "    "))
        if cap.conventions:
            out.append(_comment("conventions that change it: " + ", ".join(cap.conventions),
                                "    "))
        out.append(f'    # @implements("{cap_name}")')
        out.append(f"    # def {meth}(self, inputs, params):")
        out.append("    #     raise CaseUnsupported(\"...\")  # or return the array")
        out.append("")
    out.append("")
    out.append(f"ADAPTER = {klass}")
    return "\n".join(out) + "\n"
