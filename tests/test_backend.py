"""Backend layer: namespace/device resolution, constructors, host RNG, validation messages."""

import warnings

import numpy as np
import pytest

from kfac_ref import KFACInputError, KFACTypeError, KFACValueError
from kfac_ref import _backend as B


def test_namespace_of_returns_input_namespace(xp):
    a = xp.asarray(np.ones((2, 2)))
    assert B.namespace_of("f", a=a, b=None, c=1.0) is xp.xp


def test_namespace_of_rejects_mixed_namespaces():
    import array_api_strict as xs

    with pytest.raises(KFACTypeError, match=r"f: all arrays must come from one array namespace; "
                       r"a is from array_api_compat.numpy but b is from array_api_strict"):
        B.namespace_of("f", a=np.ones(2), b=xs.ones(2))


def test_namespace_of_rejects_mixed_devices():
    import array_api_strict as xs

    a = xs.ones(2)
    b = xs.ones(2, device=xs.Device("device1"))
    with pytest.raises(KFACTypeError, match=r"f: all arrays must live on one device; a is on .*"
                       r"CPU_DEVICE.* but b is on .*device1"):
        B.namespace_of("f", a=a, b=b)


def test_namespace_of_rejects_non_arrays_and_empty():
    with pytest.raises(KFACTypeError, match=r"f: a must be an array .*; got a list of length 2"):
        B.namespace_of("f", a=[1, 2])
    with pytest.raises(KFACTypeError, match=r"f: a must be an array; got None \(NoneType\)"):
        B.namespace_of("f", a=None)
    with pytest.raises(KFACTypeError, match="at least one array"):
        B.namespace_of("f")


def test_errors_are_standard_exceptions():
    assert issubclass(KFACValueError, ValueError) and issubclass(KFACValueError, KFACInputError)
    assert issubclass(KFACTypeError, TypeError) and issubclass(KFACTypeError, KFACInputError)


def test_constructors_keep_namespace_device_dtype(xp):
    a = xp.asarray(np.ones((3, 2)))
    for out, shape in ((B.eye_like(a, 4), (4, 4)), (B.zeros_like_shape(a, (2, 5)), (2, 5)),
                       (B.ones_like_shape(a, (1,)), (1,)), (B.asarray_like([1.0, 2.0], a), (2,))):
        xp.check(out)
        assert tuple(out.shape) == shape
    np.testing.assert_array_equal(xp.to_numpy(B.eye_like(a, 3)), np.eye(3))


def test_host_draw_same_numbers_on_every_backend(xp):
    like = xp.asarray(np.zeros(1))
    out = B.host_draw(np.random.default_rng(7), like, lambda r: r.standard_normal(5))
    xp.check(out)
    expected = xp.round_host(np.random.default_rng(7).standard_normal(5))
    np.testing.assert_array_equal(xp.to_numpy(out), expected)


def test_check_rng():
    with pytest.raises(KFACTypeError, match=r"f: rng must be a numpy.random.Generator .*; got 0"):
        B.check_rng("f", "rng", 0)
    assert B.check_rng("f", "rng", np.random.default_rng()) is not None


@pytest.mark.parametrize(
    ("kwargs", "value", "message"),
    [
        ({"ndim": 2, "layout": "[n, d]"}, np.ones(3),
         r"f: x must be a 2-D array \[n, d\]; got a 1-D float64 array of shape \(3,\)\."),
        ({"shape": (2, None)}, np.ones((3, 4)),
         r"f: x must be an array of shape \(2, \*\); got a 2-D float64 array of shape \(3, 4\)"),
        ({}, np.ones(3, dtype=np.int64), r"f: x must be an array of real floating dtype; got"),
        ({}, np.array([1.0, np.inf, np.nan]),
         r"f: x must be finite \(no NaN or Inf\); got 2 non-finite entries"),
        ({"min_ndim": 2}, np.ones(2), r"f: x must be an array of at least 2 dimensions"),
    ],
)
def test_check_array_messages(kwargs, value, message):
    with pytest.raises(KFACInputError, match=message):
        B.check_array("f", "x", B.asarray_like(value, np.ones(1), dtype=value.dtype), **kwargs)


def test_check_array_finite_on_every_backend(xp):
    bad = xp.asarray(np.array([0.0, np.nan]))
    with pytest.raises(KFACValueError, match="finite"):
        B.check_array("f", "x", bad)
    assert B.check_array("f", "x", bad, finite=False) is bad


def test_check_symmetric(xp):
    m = np.array([[1.0, 2.0], [2.0 + 1e-3, 1.0]])
    with pytest.raises(KFACValueError, match=r"f: m must be a symmetric matrix; got max\|M - Mᵀ\|"):
        B.check_symmetric("f", "m", xp.asarray(m))
    # rounding-level asymmetry is accepted
    ok = np.array([[1.0, 2.0], [2.0 * (1 + xp.eps), 1.0]])
    B.check_symmetric("f", "m", xp.asarray(ok))
    with pytest.raises(KFACValueError, match="square matrix"):
        B.check_symmetric("f", "m", xp.asarray(np.ones((2, 3))))


@pytest.mark.parametrize(
    ("value", "kwargs", "message"),
    [
        (-1.0, {"nonnegative": True}, r"f: d must be non-negative; got -1.0 \(float\)"),
        (0.0, {"positive": True}, "f: d must be positive"),
        ("1", {}, r"f: d must be a real number; got '1' \(str\)"),
        (True, {}, "f: d must be a real number"),
        (float("nan"), {}, "f: d must be finite"),
        (1.5, {"integer": True}, "f: d must be an integer"),
    ],
)
def test_check_scalar_messages(value, kwargs, message):
    with pytest.raises(KFACInputError, match=message):
        B.check_scalar("f", "d", value, **kwargs)


def test_check_option_and_int():
    with pytest.raises(KFACValueError, match=r"f: mode must be one of 'a', 'b'; got 'c' \(str\)"):
        B.check_option("f", "mode", "c", ("a", "b"))
    with pytest.raises(KFACTypeError, match="f: n must be an integer"):
        B.check_int("f", "n", 2.0)
    with pytest.raises(KFACValueError, match="f: n must be an integer >= 1"):
        B.check_int("f", "n", 0, minimum=1)


def test_namespace_of_rejects_mixed_float_precisions():
    a32, a64 = np.ones(2, dtype=np.float32), np.ones(2)
    with pytest.raises(KFACTypeError, match=r"f: b must have the floating dtype of a "
                       r"\(float32\); got float64. kfac_ref does not mix precisions"):
        B.namespace_of("f", a=a32, b=a64)
    # integer/bool arrays (ids, labels, masks) may accompany either precision
    assert B.namespace_of("f", a=a32, ids=np.arange(2), m=np.ones(2, bool)) is not None


def test_value_checks_switch_skips_only_value_checks(xp):
    bad = xp.asarray(np.array([[np.nan, 1.0]]))
    with pytest.raises(KFACValueError, match="finite"):
        B.check_array("f", "x", bad, ndim=2)
    asym = xp.asarray(np.array([[1.0, 2.0], [0.0, 1.0]]))
    with pytest.raises(KFACValueError, match="symmetric"):
        B.check_symmetric("f", "m", asym)
    with B.value_checks(False):
        assert not B.value_checks_enabled()
        assert B.check_array("f", "x", bad, ndim=2) is bad
        assert B.check_symmetric("f", "m", asym) is asym
        with pytest.raises(KFACValueError, match="2-D"):  # static checks still run
            B.check_array("f", "x", bad, ndim=3)
        with B.value_checks(True):  # nests
            assert B.value_checks_enabled()
    assert B.value_checks_enabled()
    with pytest.raises(KFACTypeError, match="value_checks: enabled must be a bool"):
        with B.value_checks("no"):
            pass


def test_value_checks_scan_once_per_argument(xp, monkeypatch):
    calls = []
    real = B.all_finite
    monkeypatch.setattr(B, "all_finite", lambda ns, x: calls.append(x.shape) or real(ns, x))
    B.check_array("f", "x", xp.asarray(np.ones((2, 3))), ndim=2)
    assert calls == [(2, 3)]
    with B.value_checks(False):
        B.check_array("f", "x", xp.asarray(np.ones((2, 3))), ndim=2)
    assert calls == [(2, 3)]


def test_is_lazy_eager_backends(xp):
    assert not B.is_lazy(xp.asarray(np.ones(2)))
    assert B.checks_values(xp.asarray(np.ones(2)), None)


def test_is_lazy_jax_tracer_and_dask():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    assert not B.is_lazy(jnp.ones(2))
    seen = []
    jax.jit(lambda x: seen.append(B.is_lazy(x)) or x)(jnp.ones(2))
    assert seen == [True]
    da = pytest.importorskip("dask.array")
    assert B.is_lazy(da.ones(4, chunks=2))


def test_is_lazy_torch_func_transform():
    torch = pytest.importorskip("torch")
    seen = []
    torch.func.vmap(lambda t: seen.append(B.is_lazy(t)) or t * 2)(torch.ones(3, 2))
    assert seen == [True]
    assert not B.is_lazy(torch.ones(2))


def test_kernel_of_registers_the_unchecked_kernel():
    def public(x):
        return _kernel(x)

    @B.kernel_of(public)
    def _kernel(x):
        return x + 1

    assert public.kernel is _kernel and public(1) == 2




def test_namespace_of_treats_an_unknown_device_as_compatible(monkeypatch):
    """A traced array's device is unknown (None); it may sit next to any known device, and
    the known devices must still agree."""
    xs = pytest.importorskip("array_api_strict")
    a = xs.ones(2, dtype=xs.float64)
    b = xs.ones(2, dtype=xs.float64, device=xs.Device("device1"))
    unknown = xs.ones(2, dtype=xs.float64)
    real = B.array_api_compat.device
    monkeypatch.setattr(B.array_api_compat, "device",
                        lambda x: None if x is unknown else real(x))
    assert B.namespace_of("f", x=unknown, y=a) is B.namespace_of("f", y=a)
    assert B.namespace_of("f", x=unknown, y=b) is B.namespace_of("f", y=b)
    with pytest.raises(KFACTypeError, match="f: all arrays must live on one device; y is on"):
        B.namespace_of("f", x=unknown, y=a, z=b)


def test_any_true_reads_eager_flags_and_passes_staged_out_ones():
    assert B.any_true(np, np.array([False, True]))
    assert not B.any_true(np, np.array([False, False]))
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    concrete = jnp.asarray([True])  # closed over: its reduction is staged out under jit
    seen = []
    jax.jit(lambda x: seen.append(B.any_true(jnp, concrete)) or x)(jnp.ones(1))
    assert seen == [False]


def test_check_eager_names_function_and_argument():
    B.check_eager("f", "reason", x=np.ones(2), y=None)
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    def f(x):
        B.check_eager("report", "it returns floats", x=x)
        return x

    with pytest.raises(KFACTypeError, match=r"^report: cannot run under jax.jit or on lazy "
                                            r"arrays \(it returns floats\); x must be an "
                                            r"eager array; got a 1-D .* \(lazy\)\."):
        jax.jit(f)(jnp.ones(2))


def test_finiteness_scan_finds_every_non_finite_entry_and_passes_an_overflowing_sum(xp):
    big = float(np.finfo(np.float64 if xp.float64 else np.float32).max) / 2
    # the entries are finite but their sum overflows: the sum scan must re-check entry-wise
    ok = xp.asarray(np.array([big, big, big, -1.0]))
    assert B.check_array("f", "x", ok) is ok
    for bad, n in (([1.0, np.nan, 2.0], 1), ([np.inf, -np.inf], 2), ([big, big, np.inf], 1),
                   ([-np.inf, 0.0], 1)):
        with pytest.raises(KFACValueError, match=rf"f: x must be finite .*; got {n} non-finite"):
            B.check_array("f", "x", xp.asarray(np.array(bad)))


@pytest.mark.parametrize("layout", ["C", "F", "strided"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64,
                                   np.dtype(np.float64).newbyteorder()])
def test_the_numpy_scan_in_every_layout_and_dtype(layout, dtype, monkeypatch):
    # native float32/float64 in C or F order take the dot-product scan (a byte-swapped array
    # would be copied for it), the rest all(isfinite)
    dots, real_vdot = [], np.vdot
    monkeypatch.setattr(np, "vdot", lambda a, b: dots.append(a.shape) or real_vdot(a, b))
    make = {"C": np.ascontiguousarray, "F": np.asfortranarray,
            "strided": lambda a: a[:, ::2]}[layout]
    base = (np.arange(24).reshape(4, 6) / 7).astype(dtype)
    assert B.all_finite(B.array_namespace(base), make(base))
    for bad in (np.nan, np.inf, -np.inf):
        arr = base.copy()
        arr[2, 4] = bad
        assert not B.all_finite(B.array_namespace(arr), make(arr))
    # finite entries whose squares (and sum) overflow: re-checked entry-wise, no warning
    big = np.full((4, 6), np.finfo(dtype).max, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert B.all_finite(B.array_namespace(big), make(big))
    by_dot = layout != "strided" and dtype in (np.float32, np.float64)
    assert dots == ([(24,)] * 5 if by_dot else [])


def test_remembered_namespaces_never_admit_a_scalar():
    B.array_namespace(np.float64(1.0))  # a NumPy scalar has a type and a dtype, too
    with pytest.raises(KFACTypeError, match=r"f: x must be an array; got np.float64\(1.0\)"):
        B.check_array("f", "x", np.float64(1.0))
    assert B.namespace_of("f", a=np.ones(2), b=np.float64(2.0)) is B.array_namespace(np.ones(2))


def test_reshape_is_the_namespace_reshape(xp):
    x = xp.asarray(np.arange(6.0))
    got = B.reshape(B.array_namespace(x), x, (2, 3))
    want = xp.xp.reshape(x, (2, 3))
    assert type(got) is type(want) and got.dtype == x.dtype
    assert B.device_of(got) == B.device_of(x)
    np.testing.assert_array_equal(xp.to_numpy(got), xp.to_numpy(want))


def test_one_like_fills_a_where_in_the_arrays_dtype_and_device(xp):
    """A 1 that keeps a ``where`` in ``x``'s dtype (a NumPy scalar of that dtype for NumPy
    arrays and scalars: a Python 1.0 would promote float32 to float64 on NumPy < 2)."""
    x = xp.xp.max(xp.asarray(np.array([-3.0, 2.0])))  # 0-D (a NumPy scalar on NumPy)
    ns = B.array_namespace(x)
    one = B.one_like(ns, x)
    got = ns.where(x < 0, x, one)
    assert got.dtype == x.dtype and float(got) == 1.0
    assert B.device_of(got) == B.device_of(x)
    if isinstance(x, (np.ndarray, np.generic)):
        assert type(one) is x.dtype.type


def test_check_array_shape_with_and_without_free_entries():
    x = np.ones((3, 4))
    assert B.check_array("f", "x", x, shape=(3, 4)) is x
    assert B.check_array("f", "x", x, shape=[None, 4]) is x
    for bad in ((4, 3), (3, None, 1), (3,)):
        with pytest.raises(KFACValueError, match="must be an array of shape"):
            B.check_array("f", "x", x, shape=bad)


def _two_step_error(func, name, x, like_name, like, shape):
    """The error of check_array then namespace_of, the checks check_array_like stands for."""
    try:
        B.check_array(func, name, x, shape=shape, layout="[P]")
        B.namespace_of(func, **{name: x, like_name: like})
    except KFACInputError as exc:
        return type(exc), str(exc)
    return None


def test_check_array_like_is_check_array_and_namespace_of_in_one_call(xp, monkeypatch):
    import array_api_strict as xs

    like = xp.asarray(np.zeros(()))
    good = xp.asarray(np.arange(3.0))
    scans = []
    real = B.all_finite
    monkeypatch.setattr(B, "all_finite", lambda ns, x: scans.append(x.shape) or real(ns, x))
    assert B.check_array_like("f", "v", good, "like", like, shape=(3,)) is good
    assert scans == [(3,)]  # the matching case: one finiteness scan, nothing else read
    cases = {
        "non-finite": xp.asarray(np.array([0.0, np.inf, 1.0])),
        "shape": xp.asarray(np.arange(4.0)),
        "rank": xp.asarray(np.ones((3, 1))),
        "integer": xp.asarray(np.arange(3)),
        "namespace": np.arange(3.0) if xp.name.startswith("strict") else xs.asarray(
            np.arange(3.0)),
        "not an array": [0.0, 1.0, 2.0],
    }
    if xp.name != "strict-no_float64":  # a device without float64 has one precision
        cases["precision"] = xp.xp.asarray(
            good, dtype=xp.xp.float32 if xp.float64 else xp.xp.float64)
    if xp.name.startswith("strict"):
        other = "device1" if xp.name != "strict-device1" else "CPU_DEVICE"
        cases["device"] = xs.asarray(np.arange(3.0), dtype=good.dtype, device=xs.Device(other))
    for what, bad in cases.items():
        want = _two_step_error("f", "v", bad, "like", like, (3,))
        assert want is not None, what
        with pytest.raises(want[0]) as got:
            B.check_array_like("f", "v", bad, "like", like, shape=(3,), layout="[P]")
        assert str(got.value) == want[1], what
    with B.value_checks(False):  # the scan is a value check; the static checks stay
        assert B.check_array_like("f", "v", cases["non-finite"], "like", like, shape=(3,)) \
            is cases["non-finite"]
        with pytest.raises(KFACValueError, match=r"f: v must be an array of shape \(3\)"):
            B.check_array_like("f", "v", cases["shape"], "like", like, shape=(3,))
