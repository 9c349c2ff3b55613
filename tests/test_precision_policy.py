"""The precision policy: float32 and float64 only.  Half-precision input (float16, and
bfloat16 where the library has it) is refused at the boundary of every public function by
the one dtype check (``kfac_ref._backend.check_array``) with a KFACTypeError naming the
argument — never computed in float32 and handed back promoted.  And a torch argument that
requires grad is read on the host without torch's warning."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import kfac_ref
from kfac_ref import KFACTypeError, factors, linalg

HALF_MESSAGE = (r"must be a float32 or float64 array \(half precision is not supported: "
                r"LAPACK has no half precision; cast to float32\); got a \d-D ")


def _spd(n, seed=0):
    r = np.random.default_rng(seed)
    x = r.standard_normal((n, n))
    return x @ x.T / n + np.eye(n)


# (name, call, the argument the message must name); each call gets a converter ``c`` that
# puts a float64 NumPy array into the backend and dtype under test.
CALLS = [
    ("damped_inverse", lambda c: linalg.damped_inverse(c(_spd(3)), 0.1), "matrix"),
    ("damped_matpower", lambda c: linalg.damped_matpower(c(_spd(3)), -0.5, 0.1), "matrix"),
    ("clipped_eigh", lambda c: linalg.clipped_eigh(c(_spd(3))), "matrix"),
    ("factor_norm", lambda c: linalg.factor_norm(c(_spd(3)), "avg_diag"), "matrix"),
    ("kron_damped_inverse_matvec",
     lambda c: linalg.kron_damped_inverse_matvec(c(_spd(2)), c(_spd(3, 1)), c(np.ones(6)),
                                                 0.1), "a"),
    ("compute_cov", lambda c: linalg.compute_cov(c(np.ones((4, 3)))), "tensor"),
    ("kron", lambda c: linalg.kron(c(_spd(2)), c(_spd(2, 1))), "a"),
    ("pi_tracenorm", lambda c: linalg.pi_tracenorm(c(_spd(2)), c(_spd(3, 1))), "left_cov"),
    ("fully_connected_kronecker_factor",
     lambda c: factors.fully_connected_kronecker_factor(c(np.ones((4, 3)))), None),
]


def _backends():
    out = [pytest.param("numpy", "float16", id="numpy-float16")]
    try:
        import torch  # noqa: F401
    except ImportError:
        out.append(pytest.param("torch", "float16", id="torch-float16",
                                marks=pytest.mark.skip(reason="torch is not installed")))
        return out
    out += [pytest.param("torch", "float16", id="torch-float16"),
            pytest.param("torch", "bfloat16", id="torch-bfloat16")]
    return out


def _converter(backend, dtype):
    if backend == "numpy":
        return lambda a: np.asarray(a, dtype=getattr(np, dtype))
    import torch

    return lambda a: torch.asarray(np.asarray(a), dtype=getattr(torch, dtype))


@pytest.mark.parametrize(("backend", "dtype"), _backends())
@pytest.mark.parametrize(("name", "call", "argument"), CALLS, ids=[c[0] for c in CALLS])
def test_half_precision_is_refused_with_the_argument_named(backend, dtype, name, call,
                                                           argument):
    with pytest.raises(KFACTypeError, match=HALF_MESSAGE) as exc:
        call(_converter(backend, dtype))
    text = str(exc.value)
    assert text.startswith(f"{name}: "), text
    if argument:
        assert text.startswith(f"{name}: {argument} must be"), text
    assert dtype in text  # what was given
    assert isinstance(exc.value, TypeError)  # a KFACTypeError is a TypeError


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_single_and_double_precision_keep_their_dtype(dtype):
    m = _spd(3).astype(dtype)
    for out in (linalg.damped_inverse(m, 0.1), linalg.damped_matpower(m, -0.5, 0.1),
                linalg.kron_damped_inverse_matvec(m, m, np.ones(9, dtype=dtype), 0.1)):
        assert out.dtype == np.dtype(dtype)


def test_the_policy_is_stated_on_the_conventions_page():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "conventions.rst").read_text(
        encoding="utf-8")
    assert "Precision" in text and "float16" in text and "bfloat16" in text
    assert "KFACTypeError" in text


def test_requires_grad_tensors_are_read_without_a_torch_warning():
    torch = pytest.importorskip("torch")
    a = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cov = kfac_ref.compute_cov(a)
        inv = kfac_ref.damped_inverse(cov, 0.1)
        # a 0-D damping that requires grad is read on the host too
        kfac_ref.damped_inverse(cov, torch.tensor(0.1, dtype=torch.float64,
                                                  requires_grad=True))
    assert inv.requires_grad  # the result keeps its autograd history
    inv.sum().backward()
    assert a.grad is not None and a.grad.shape == a.shape
