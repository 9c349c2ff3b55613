"""0-D arrays of a given kind for the tests of hyper-parameters given as arrays: of the
arrays' own namespace and precision, of the other precision, of another namespace."""

from __future__ import annotations

import numpy as np
import pytest


def own(xp, value):
    """``value`` as an array of the namespace, device and precision under test."""
    return xp.asarray(np.asarray(value))


def other_precision(xp, value):
    """``value`` in the namespace under test, in the other float precision."""
    try:
        return xp.xp.asarray(value, dtype=xp.xp.float32 if xp.float64 else xp.xp.float64,
                             device=xp.device)
    except ValueError:  # a device without float64
        pytest.skip("the device under test has one floating precision")


def other_namespace(xp, value):
    """``value`` in the precision under test, from another library (torch next to NumPy,
    NumPy next to the rest)."""
    if xp.name.startswith("numpy"):
        torch = pytest.importorskip("torch")
        return torch.tensor(value, dtype=torch.float64 if xp.float64 else torch.float32)
    return np.asarray(value, dtype=np.float64 if xp.float64 else np.float32)


#: kind -> (how the 0-D array is made, what the refusal says about the argument ``{arg}``)
REFUSALS = {
    "other_precision": (other_precision, r"\b{arg} must have the floating dtype of"),
    "other_namespace": (other_namespace, r"all arrays must come from one array namespace; "
                                         r".* but {arg} is from"),
}
