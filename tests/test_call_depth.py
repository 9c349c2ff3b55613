"""A Kronecker block's damped inverse reaches the backend's Cholesky in few hops.

``tools/trace_calls.py`` records, under ``sys.setprofile``, the kfac_ref frames between the
public ``multiply_inverse`` of a conv / dense Kronecker block (approximate π damping,
uncached) and the backend's Cholesky routine (LAPACK ``potrf`` through SciPy, or a
namespace's ``linalg.cholesky``).  A reader follows the formula from the public method to
LAPACK through at most 4 files and 6 calls.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_TOOL = Path(__file__).resolve().parents[1] / "tools" / "trace_calls.py"


def _tool():
    if "trace_calls" not in sys.modules:
        spec = importlib.util.spec_from_file_location("trace_calls", _TOOL)
        module = importlib.util.module_from_spec(spec)
        sys.modules["trace_calls"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["trace_calls"]


@pytest.mark.parametrize("kind", ["conv", "dense"])
def test_kronecker_multiply_inverse_reaches_cholesky_in_few_hops(kind):
    chain = _tool().kronecker_inverse_chain(kind)
    assert chain is not None, "multiply_inverse made no backend Cholesky call"
    assert chain.frames[0][2] == "multiply_inverse", str(chain)
    assert chain.frames[-1][0].endswith("_backend.py"), str(chain)
    assert chain.files <= 4, str(chain)
    assert chain.calls <= 6, str(chain)


def test_trace_sees_a_longer_chain():
    """The tracer can fail: a call through one more helper is one more counted call."""
    import numpy as np

    from kfac_ref import linalg

    tool = _tool()

    def outer(m):
        return linalg.damped_inverse(m, 0.1)

    chain, _ = tool.trace(outer, np.eye(3) * 2.0)
    assert [name for _, _, name in chain.frames] == [
        "damped_inverse", "_damped_inverse", "_damped_cholesky", "cholesky_lower"]
    assert chain.calls == 4 and chain.files == 2
