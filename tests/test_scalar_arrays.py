"""Hyper-parameters given as 0-D arrays (a damping, a scale, a weight kept on the device or
traced): one of the arrays' own namespace and precision gives the numbers of the Python
float; one of the other precision or of another namespace is refused at the boundary, with
the function and the argument named, instead of turning a float32 result into float64 or
failing inside the array library (``check_scalar(..., like=...)``)."""

from __future__ import annotations

import numpy as np
import pytest

from kfac_ref import KFACTypeError, averaging, blocks, factors, linalg, spectral
from kfac_ref.blocks import tf


def _spd(n, seed):
    r = np.random.default_rng(seed)
    x = r.standard_normal((n, n))
    return x @ x.T / n + np.eye(n)


_R = np.random.default_rng(3)
_ROWS, _VEC, _X = _R.standard_normal((4, 3)), _R.standard_normal(6), _R.standard_normal((3, 2))
_A, _G, _M, _D = _spd(3, 1), _spd(2, 2), _spd(6, 4), 1.0 + _R.random(6)

# (id, call(c, s) with c the array converter and s the scalar, scalar value, argument, name
# of the public function or method in the message)
CALLS = [
    ("damped_matpower", lambda c, s: linalg.damped_matpower(c(_A), -0.5, s), 0.1, "damping",
     "damped_matpower"),
    ("damped_matpower.threshold",
     lambda c, s: linalg.damped_matpower(c(_A), -0.5, 0.1, eigenvalue_clipping_threshold=s),
     0.01, "eigenvalue_clipping_threshold", "damped_matpower"),
    ("damped_inverse", lambda c, s: linalg.damped_inverse(c(_A), s), 0.1, "damping",
     "damped_inverse"),
    ("damped_cholesky", lambda c, s: linalg.damped_cholesky(c(_A), s), 0.1, "damping",
     "damped_cholesky"),
    ("compute_cov", lambda c, s: linalg.compute_cov(c(_ROWS), normalizer=s), 4.0,
     "normalizer", "compute_cov"),
    ("append_homog", lambda c, s: linalg.append_homog(c(_ROWS), s), 1.0, "homog_value",
     "append_homog"),
    ("pi_adjusted_damping", lambda c, s: linalg.pi_adjusted_damping(c(_A), c(_G), s)[0], 0.1,
     "damping", "pi_adjusted_damping"),
    ("kron_damped_inverse_matvec",
     lambda c, s: linalg.kron_damped_inverse_matvec(c(_A), c(_G), c(_X), s), 0.1, "damping",
     "kron_damped_inverse_matvec"),
    ("kron_eigenvalues", lambda c, s: spectral.kron_eigenvalues(c(_A), c(_G), s), 0.1,
     "damping", "kron_eigenvalues"),
    ("kron_eigenvalues.scale",
     lambda c, s: spectral.kron_eigenvalues(c(_A), c(_G), 0.1, scale=s), 2.0, "scale",
     "kron_eigenvalues"),
    ("kronecker_block_matpower",
     lambda c, s: blocks.kronecker_block_matpower(c(_A), c(_G), c(_X), -1.0, s), 0.1,
     "damping", "kronecker_block_matpower"),
    ("diagonal_block_matpower",
     lambda c, s: blocks.diagonal_block_matpower(c(_D), c(_VEC), -1.0, s), 0.1, "damping",
     "diagonal_block_matpower"),
    ("full_block_matpower",
     lambda c, s: blocks.full_block_matpower(c(_M), c(_VEC), -1.0, 0.1, scale=s), 2.0,
     "scale", "full_block_matpower"),
    ("scaled_identity_matpower",
     lambda c, s: blocks.scaled_identity_matpower(c(_VEC), -1.0, s), 0.1, "damping",
     "scaled_identity_matpower"),
    ("weighted_accumulate",
     lambda c, s: averaging.weighted_accumulate(c(_A), c(_A), s, 1.0), 0.5, "old_weight",
     "weighted_accumulate"),
    ("WeightedMovingAverage.update",
     lambda c, s: averaging.WeightedMovingAverage.zeros_like(c(_A)).update(c(_A), 0.0,
                                                                           s).value,
     0.5, "ema_new", "WeightedMovingAverage.update"),
    ("naive_diagonal_factor", lambda c, s: factors.naive_diagonal_factor(c(_VEC), s), 4.0,
     "batch_size", "naive_diagonal_factor"),
    ("conv_input_sua_factor",
     lambda c, s: factors.conv_input_sua_factor(c(_A), c(_A[0]), 4, damping=s), 0.1,
     "damping", "conv_input_sua_factor"),
    ("FullFB", lambda c, s: tf.FullFB(c(_M), s).multiply_inverse(c(_VEC)), 0.1, "damping",
     "FullFB"),
    ("FullFB.callable", lambda c, s: tf.FullFB(c(_M), lambda: s).multiply_inverse(c(_VEC)),
     0.1, "damping", "FullFB"),
    ("KroneckerProductFB",
     lambda c, s: tf.KroneckerProductFB(c(_A), c(_G), s, (3, 2)).multiply_inverse(c(_X)),
     0.1, "damping", "KroneckerProductFB"),
    ("KroneckerProductFB.renorm_coeff",
     lambda c, s: tf.KroneckerProductFB(c(_A), c(_G), 0.1, (3, 2),
                                        renorm_coeff=s).multiply_inverse(c(_X)),
     2.0, "renorm_coeff", "KroneckerProductFB"),
    ("FullFactor.callable", lambda c, s: _full_factor_inverse(c, lambda: s), 0.1,
     "damping_func\\(\\)", "FullFactor"),
]
_IDS = [case[0] for case in CALLS]


def _full_factor_inverse(c, s):
    """A TF-style factor's registered damped inverse, the damping a 0-D array."""
    f = factors.FullFactor(4.0).update_cov([c(_VEC)], ema_decay=0.0)
    return f.register_inverse(s).update_inverses().get_inverse(s)


def test_a_factor_registers_an_array_damping_as_a_callable(xp):
    # registrations are keys compared by value: a bare array is refused, with the remedy
    f = factors.FullFactor(4.0).update_cov([xp.asarray(_VEC)], ema_decay=0.0)
    with pytest.raises(KFACTypeError, match=r"^FullFactor\.register_matpower: damping must be "
                                            r"a real number or a zero-argument callable; got "
                                            r"a 0-D .*\(lambda: damping\)"):
        f.register_inverse(xp.asarray(np.asarray(0.1)))


def _own(xp, value):
    return xp.asarray(np.asarray(value))


def _other_precision(xp, value):
    try:
        return xp.xp.asarray(value, dtype=xp.xp.float32 if xp.float64 else xp.xp.float64,
                             device=xp.device)
    except ValueError:  # a device without float64
        pytest.skip("the device under test has one floating precision")


def _other_namespace(xp, value):
    if xp.name.startswith("numpy"):
        torch = pytest.importorskip("torch")
        return torch.tensor(value, dtype=torch.float64 if xp.float64 else torch.float32)
    return np.asarray(value, dtype=np.float64 if xp.float64 else np.float32)


@pytest.mark.parametrize(("case", "call", "value", "arg", "func"), CALLS, ids=_IDS)
def test_a_0d_scalar_of_the_arrays_kind_gives_the_numbers_of_the_float(xp, case, call, value,
                                                                       arg, func):
    want = call(xp.asarray, value)
    got = call(xp.asarray, _own(xp, value))
    assert got.dtype == want.dtype
    np.testing.assert_allclose(xp.to_numpy(got), xp.to_numpy(want),
                               rtol=1e-12 if xp.float64 else 1e-5)


# how a 0-D scalar of another kind than the arrays is made, and what the refusal says
_REFUSALS = {
    "other_precision": (_other_precision, r"\b{arg} must have the floating dtype of"),
    "other_namespace": (_other_namespace, r"all arrays must come from one array namespace; "
                                          r".* but {arg} is from"),
}


@pytest.mark.parametrize("kind", sorted(_REFUSALS))
@pytest.mark.parametrize(("case", "call", "value", "arg", "func"), CALLS, ids=_IDS)
def test_a_0d_scalar_of_another_kind_is_refused(xp, kind, case, call, value, arg, func):
    make, message = _REFUSALS[kind]
    with pytest.raises(KFACTypeError, match=rf"^{func}[.:].*" + message.format(arg=arg)):
        call(xp.asarray, make(xp, value))


@pytest.mark.usefixtures("jax_x64")
def test_a_python_number_traced_by_jit_takes_the_arrays_precision():
    # inside jax.jit a Python-number argument is a weakly typed float64 tracer: like the
    # number, it adopts the float32 arrays' precision, so it is not refused
    import jax
    import jax.numpy as jnp

    a = jnp.asarray(_A, dtype=jnp.float32)
    got = jax.jit(lambda d: linalg.damped_inverse(a, d))(0.1)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(linalg.damped_inverse(a, 0.1)),
                               rtol=1e-5)
    with pytest.raises(KFACTypeError, match=r"^damped_inverse: damping must have the floating "
                                            r"dtype of matrix \(float32\); got float64"):
        jax.jit(lambda d: linalg.damped_inverse(a, d))(jnp.asarray(0.1, dtype=jnp.float64))
