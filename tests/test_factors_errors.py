"""Bad inputs to the factor and patch functions: the error names the function the user
called and the argument they passed (issue reports of misattributed errors)."""

import numpy as np
import pytest

from kfac_ref import KFACInputError, KFACTypeError, KFACValueError, factors
from kfac_ref._backend import is_array
from kfac_ref.patches import extract_image_patches


@pytest.mark.parametrize("bad", [float("nan"), 0.0, 1.5, -0.2, "0.2", True])
@pytest.mark.parametrize("sub_sample", [False, True])
def test_inputs_to_extract_patches_factor_is_named(xp, rng, bad, sub_sample):
    x = xp.asarray(rng.standard_normal((2, 5, 5, 3)))
    with pytest.raises(KFACInputError, match="^conv_input_kronecker_factor: "
                       "inputs_to_extract_patches_factor must be"):
        factors.conv_input_kronecker_factor(x, (3, 3, 3, 4), "SAME",
                                            sub_sample_inputs=sub_sample,
                                            rng=np.random.default_rng(0),
                                            inputs_to_extract_patches_factor=bad)


@pytest.mark.parametrize("rates, err", [(0, KFACValueError), ((1, 0), KFACValueError),
                                        (1.5, KFACTypeError), ((1, 1, 1), KFACValueError)])
def test_extract_image_patches_names_rates(xp, rng, rates, err):
    x = xp.asarray(rng.standard_normal((2, 5, 5, 3)))
    with pytest.raises(err, match="^extract_image_patches: rates must"):
        extract_image_patches(x, (2, 2), 1, rates, "SAME")


@pytest.mark.parametrize("which", ["ksizes", "strides", "rates"])
def test_extract_image_patches_needs_its_sizes(xp, rng, which):
    x = xp.asarray(rng.standard_normal((2, 5, 5, 3)))
    args = dict(ksizes=(2, 2), strides=1, rates=1)
    args[which] = None  # None used to mean a 1×1 kernel silently
    with pytest.raises(KFACTypeError, match=f"^extract_image_patches: {which} must be"):
        extract_image_patches(x, args["ksizes"], args["strides"], args["rates"], "SAME")
    with pytest.raises(KFACTypeError, match="^extract_image_patches: ksizes must be"):
        extract_image_patches(x, None, None, None, "SAME")


def test_factor_functions_return_arrays(xp, rng):
    """No factor function returns a Python float where an array is expected."""
    x = xp.asarray(rng.standard_normal((2, 5, 5, 3)))
    g = xp.asarray(rng.standard_normal((2, 5, 5, 4)))
    a = xp.asarray(rng.standard_normal((4, 3)))
    ga = xp.asarray(rng.standard_normal((4, 2)))
    ids = xp.asarray(np.array([0, 2, 2, 1]))
    sigma, mu = factors.conv_input_sua_statistics(x)
    results = [
        factors.conv_input_kronecker_factor(x, (3, 3, 3, 4), "SAME"),
        factors.conv_output_kronecker_factor(g),
        factors.conv_diagonal_factor(x, g, (3, 3, 3, 4), 1, "SAME"),
        factors.conv_patch_matrix(x, (3, 3, 3, 4), "SAME"),
        factors.conv_per_example_gradients(x, g, (3, 3, 3, 4), 1, "SAME"),
        sigma, mu, factors.conv_input_sua_factor(sigma, mu, 9, True, 0.1),
        factors.fully_connected_kronecker_factor(a, True),
        factors.fully_connected_diagonal_factor(a, ga, True),
        factors.naive_diagonal_factor([ga], 4), factors.full_factor([ga], 4),
        factors.embedding_input_kronecker_factor(ids, 3),
        factors.diagonal_kronecker_factor(a, True),
        factors.scale_and_shift_factor(a, a, (), (), True),
        factors.fully_connected_multi_kf_cov_dt1(a, 2, True),
    ]
    assert all(is_array(r) for r in results)


@pytest.mark.parametrize("width", [32, 64])
def test_embedding_factor_dtype_follows_ids_not_the_default(xp, width):
    """float64 only for 64-bit ids on a device that has it; an explicit dtype wins."""
    int_dtype = getattr(xp.xp, f"int{width}")
    ids = xp.asarray(np.array([0, 2, 2, 1]), dtype=int_dtype)
    device_has_float64 = xp.name != "strict-no_float64"
    want = xp.xp.float64 if width == 64 and device_has_float64 else xp.xp.float32
    assert factors.embedding_input_kronecker_factor(ids, 3).dtype == want
    assert factors.embedding_input_kronecker_factor(ids, 3, dtype="float32").dtype == \
        xp.xp.float32
    dense = factors.DiagonalKroneckerFactor(has_bias=True).update_cov(
        xp.asarray(np.ones((3, 2))), ema_decay=0.5).cov
    assert dense.dtype == xp.dtype


def test_embedding_id_range_is_a_value_check(xp):
    from kfac_ref import value_checks

    ids = xp.asarray(np.array([0, 7]))
    with pytest.raises(KFACValueError, match="input_ids must lie in"):
        factors.embedding_input_kronecker_factor(ids, 3)
    with value_checks(False):  # no host read of the ids; out-of-range ids are not counted
        got = factors.embedding_input_kronecker_factor(ids, 3)
    np.testing.assert_allclose(xp.to_numpy(got), [0.5, 0.0, 0.0])
