"""Bad input to the reference layers, networks and parameter permutations is refused at the
public door, with a message that names the argument, and each array is scanned once.

Covers: NaN/Inf (a value check: off under ``value_checks(False)``), integer, boolean,
complex and list inputs, mixed precisions, namespaces and devices, parameter tuples of the
wrong structure, cotangents of the wrong shape, flags that are not bools, a missing
direction, the constructor of :class:`kfac_ref.nn.Sequential`, empty batches (a correct
empty result: sums over no examples are zero) and permutations that are not permutations.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

import kfac_ref._backend as B
from kfac_ref import KFACTypeError, KFACValueError, nn, value_checks

# -- layers under test: (maker, host input shape, integer input) ---------------------------
LAYERS = {
    "dense": (lambda: nn.Dense(3, 2), (4, 3), False),
    "dense-seq": (lambda: nn.Dense(3, 2, use_bias=False), (4, 5, 3), False),
    "conv-nhwc": (lambda: nn.Conv2D(2, 3, 2, padding="SAME"), (2, 4, 4, 2), False),
    "conv-nchw": (lambda: nn.Conv2D(2, 3, 3, stride=2, data_format="NCHW"),
                  (2, 2, 5, 5), False),
    "scale-shift": (lambda: nn.ScaleAndShift(3), (4, 2, 3), False),
    "activation": (lambda: nn.Activation("tanh"), (4, 3), False),
    "mean-pool": (lambda: nn.MeanPool(), (4, 2, 3), False),
    "flatten": (lambda: nn.Flatten(), (4, 2, 3), False),
    "embedding": (lambda: nn.Embedding(5, 2), (4, 3), True),
}


def _setup(xp, rng, key):
    make, shape, integer = LAYERS[key]
    layer = make()
    if integer:
        x = xp.asarray(rng.integers(0, 5, size=shape))
    else:
        x = xp.asarray(rng.standard_normal(shape))
    like = x if not integer else xp.asarray(np.zeros(1))
    params = layer.init_params(np.random.default_rng(1), like)
    out = layer.output_shape(tuple(x.shape))
    g = xp.asarray(rng.standard_normal(out))
    return layer, params, x, g


def _with_nan(xp, a):
    host = np.array(xp.to_numpy(a), dtype=np.float64)
    host.flat[0] = np.nan
    return xp.asarray(host)


def _other_device(xp):
    """A device of ``xp``'s namespace other than the one under test (strict cells)."""
    if not xp.name.startswith("strict") or xp.name == "strict-no_float64":
        pytest.skip("needs two float64 devices of one namespace (array-api-strict)")
    import array_api_strict

    return array_api_strict.Device("CPU_DEVICE" if xp.name == "strict-device1" else "device1")


CALLS = ("forward", "forward_with_tap", "jvp", "vjp_input", "vjp_input_stacked",
         "vjp_cache", "param_grads", "rvjp")


def _call(layer, method, params, x, g, **over):
    """Call ``method`` with valid arguments, ``over`` replacing some of them."""
    a = dict(params=params, x=x, g=g)
    a.update(over)
    p, xx, gg = a["params"], a["x"], a["g"]
    dp = a.get("dparams", p if p else None)
    dx = a.get("dx", None if layer.input_dtype != "real floating" else xx)
    if method == "forward":
        return layer.forward(p, xx)
    if method == "forward_with_tap":
        return layer.forward_with_tap(p, xx, a.get("tap"))
    if method == "jvp":
        return layer.jvp(p, xx, dp, dx)
    if method == "vjp_input":
        return layer.vjp_input(p, xx, gg)
    if method == "vjp_input_stacked":
        return layer.vjp_input_stacked(p, xx, gg if "g" in over else gg[None, ...])
    if method == "vjp_cache":
        return layer.vjp_cache(p, xx)
    if method == "param_grads":
        return layer.param_grads(p, xx, gg, a.get("per_example", False))
    return layer.rvjp(p, xx, dp, dx, gg, a.get("rg", gg))


# -- layers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("method", CALLS)
@pytest.mark.parametrize("key", sorted(LAYERS))
def test_layer_refuses_nan_input_unless_value_checks_are_off(xp, rng, key, method):
    layer, params, x, g = _setup(xp, rng, key)
    if LAYERS[key][2]:  # ids: the NaN goes into the parameters instead
        bad = (_with_nan(xp, params[0]),)
        with pytest.raises(KFACValueError, match=r"embeddings must be finite"):
            _call(layer, method, bad, x, g)
        return
    with pytest.raises(KFACValueError, match=rf"{type(layer).__name__}\.{method}: x must be "
                                             r"finite"):
        _call(layer, method, params, _with_nan(xp, x), g)
    if params:
        with pytest.raises(KFACValueError, match=r": w must be finite|: scale must be finite"):
            _call(layer, method, (_with_nan(xp, params[0]), *params[1:]), x, g)
    with value_checks(False):  # the switch: NaN passes through unread
        _call(layer, method, params, _with_nan(xp, x), g)


@pytest.mark.parametrize("method", ["param_grads", "vjp_input", "rvjp"])
@pytest.mark.parametrize("key", ["dense", "conv-nhwc", "scale-shift", "embedding"])
def test_layer_refuses_nan_cotangents(xp, rng, key, method):
    layer, params, x, g = _setup(xp, rng, key)
    with pytest.raises(KFACValueError, match=r": g must be finite"):
        _call(layer, method, params, x, _with_nan(xp, g))


@pytest.mark.parametrize("kind", ["int", "bool", "complex", "list"])
@pytest.mark.parametrize("key", ["dense", "conv-nhwc", "scale-shift", "activation",
                                 "mean-pool", "flatten"])
def test_layer_refuses_non_floating_inputs(xp, rng, key, kind):
    layer, params, x, _ = _setup(xp, rng, key)
    host = np.ones(tuple(x.shape))
    if kind == "list":
        bad = host.tolist()
    elif kind == "complex":
        if xp.name == "strict-no_float64":
            pytest.skip("complex128 is off on the no_float64 device")
        bad = xp.xp.asarray(host + 0j, dtype=xp.xp.complex128, device=xp.device)
    else:
        bad = xp.asarray(host.astype(np.int64 if kind == "int" else bool))
    with pytest.raises(KFACTypeError, match=r"\.forward: x must be an array"):
        layer.forward(params, bad)


@pytest.mark.parametrize("key", ["dense", "dense-seq", "conv-nhwc", "scale-shift",
                                 "embedding"])
def test_layer_refuses_non_floating_or_list_params(xp, rng, key):
    layer, params, x, g = _setup(xp, rng, key)
    name = layer.param_names()[0]
    as_int = xp.asarray(np.ones(tuple(params[0].shape), dtype=np.int64))
    with pytest.raises(KFACTypeError, match=rf": {name} must be an array of real floating"):
        layer.forward((as_int, *params[1:]), x)
    as_list = np.ones(tuple(params[0].shape)).tolist()
    with pytest.raises(KFACTypeError, match=rf": {name} must be an array"):
        layer.forward((as_list, *params[1:]), x)


def test_embedding_refuses_floating_or_out_of_range_ids(xp, rng):
    layer, params, x, _ = _setup(xp, rng, "embedding")
    with pytest.raises(KFACTypeError, match=r"Embedding\.forward: ids must be an array of "
                                            r"integral dtype"):
        layer.forward(params, xp.asarray(np.ones((4, 3))))
    with pytest.raises(KFACValueError, match=r"ids must lie in \[0, vocab_size\) = \[0, 5\)"):
        layer.forward(params, xp.asarray(np.full((4, 3), 5)))
    with pytest.raises(KFACValueError, match=r"Embedding\.jvp: dx must be None"):
        layer.jvp(params, x, params, xp.asarray(np.ones((4, 3))))


@pytest.mark.parametrize("method", CALLS)
@pytest.mark.parametrize("key", ["dense", "conv-nchw", "scale-shift", "activation"])
def test_layer_refuses_mixed_precision(xp, rng, key, method):
    if not xp.float64:
        pytest.skip("needs float64 next to float32")
    layer, params, x, g = _setup(xp, rng, key)
    x32 = xp.xp.astype(x, xp.xp.float32)
    if params or method in ("vjp_input", "vjp_input_stacked", "param_grads", "rvjp"):
        with pytest.raises(KFACTypeError, match=r"does not mix precisions"):
            _call(layer, method, params, x32, g)
    if method in ("vjp_input", "param_grads", "rvjp"):
        with pytest.raises(KFACTypeError, match=r"g must have the floating dtype"):
            _call(layer, method, params, x, xp.xp.astype(g, xp.xp.float32))


@pytest.mark.parametrize("method", ["forward", "param_grads", "rvjp"])
def test_layer_refuses_mixed_namespaces_and_devices(xp, rng, method):
    layer, params, x, g = _setup(xp, rng, "dense")
    host_params = tuple(np.asarray(xp.to_numpy(p)) for p in params)
    if xp.name == "numpy":
        import array_api_strict

        other = tuple(array_api_strict.asarray(p) for p in host_params)
        with pytest.raises(KFACTypeError, match=r"one array namespace"):
            _call(layer, method, other, x, g)
        return
    with pytest.raises(KFACTypeError, match=r"one array namespace"):
        _call(layer, method, host_params, x, g)
    dev = _other_device(xp)
    moved = tuple(xp.xp.asarray(p, device=dev) for p in host_params)
    with pytest.raises(KFACTypeError, match=r"one device"):
        _call(layer, method, moved, x, g)


@pytest.mark.parametrize("key", ["dense", "dense-seq", "conv-nhwc", "scale-shift"])
def test_param_grads_checks_the_parameters(xp, rng, key):
    """param_grads reads only W of the parameters, but a wrong b (or a wrong W) is a wrong
    call: it is refused, not ignored."""
    layer, params, x, g = _setup(xp, rng, key)
    wrong = xp.asarray(np.ones((7,)))
    bad = (*params[:-1], wrong)
    with pytest.raises(KFACValueError, match=r"\.param_grads: \w+ must be an array of shape"):
        layer.param_grads(bad, x, g)
    with pytest.raises(KFACValueError, match=r"\.param_grads: params of a \w+ layer must be "
                                             r"a tuple of"):
        layer.param_grads(params[:-1] if len(params) > 1 else (), x, g)
    with pytest.raises(KFACTypeError, match=r"\.param_grads: per_example must be a bool"):
        layer.param_grads(params, x, g, per_example="True")


@pytest.mark.parametrize("key", sorted(LAYERS))
def test_layer_refuses_cotangents_and_tangents_of_wrong_shape(xp, rng, key):
    layer, params, x, g = _setup(xp, rng, key)
    g_bad = xp.asarray(np.ones((*tuple(g.shape)[:-1], g.shape[-1] + 1)))
    for method in ("vjp_input", "param_grads", "rvjp"):
        with pytest.raises(KFACValueError, match=rf"\.{method}: g must be an array of shape"):
            _call(layer, method, params, x, g_bad)
        with pytest.raises(KFACTypeError, match=rf"\.{method}: g must be an array"):
            _call(layer, method, params, x, None)
    with pytest.raises(KFACValueError, match=r"\.vjp_input_stacked: g must be an array of "
                                             r"shape \(\*, "):
        layer.vjp_input_stacked(params, x, g)  # the stacking axis is missing
    with pytest.raises(KFACValueError, match=r"\.rvjp: rg must be an array of shape"):
        layer.rvjp(params, x, None, None, g, g_bad)
    if params:
        with pytest.raises(KFACValueError, match=r"\.jvp: dparams of a \w+ layer must be"):
            layer.jvp(params, x, params[:-1] if len(params) > 1 else (), None)
    if layer.input_dtype == "real floating":
        dx_bad = xp.asarray(np.ones((x.shape[0] + 1, *tuple(x.shape)[1:])))
        with pytest.raises(KFACValueError, match=r"\.jvp: dx must be an array of shape"):
            layer.jvp(params, x, None, dx_bad)


def test_cache_and_tap_arguments(xp, rng):
    dense, params, x, g = _setup(xp, rng, "dense")
    with pytest.raises(KFACValueError, match=r"Dense\.vjp_input: cache must be None"):
        dense.vjp_input(params, x, g, cache=x)
    with pytest.raises(KFACTypeError, match=r"Dense\.forward_with_tap: tap must be None or "
                                            r"a callable"):
        dense.forward_with_tap(params, x, "tap")
    act, _, xa, ga = _setup(xp, rng, "activation")
    cache = act.vjp_cache((), xa)
    xp.assert_close(act.vjp_input((), xa, ga, cache=cache),
                    xp.to_numpy(act.vjp_input((), xa, ga)))
    with pytest.raises(KFACValueError, match=r"Activation\.vjp_input: cache must be an array "
                                             r"of shape"):
        act.vjp_input((), xa, ga, cache=ga[:, :1])


@pytest.mark.parametrize("key", sorted(LAYERS))
def test_layer_init_params_and_output_shape_arguments(xp, rng, key):
    layer = LAYERS[key][0]()
    like = xp.asarray(np.zeros(2))
    with pytest.raises(KFACTypeError, match=r"\.init_params: rng must be a numpy.random"):
        layer.init_params(0, like)
    with pytest.raises(KFACTypeError, match=r"\.init_params: like must be an array"):
        layer.init_params(np.random.default_rng(0), [0.0])
    with pytest.raises(KFACTypeError, match=r"\.init_params: like must be an array of real "
                                            r"floating dtype"):
        layer.init_params(np.random.default_rng(0), xp.asarray(np.zeros(2, dtype=np.int64)))
    with pytest.raises(KFACTypeError, match=r"\.output_shape: input_shape must be"):
        layer.output_shape("abc")
    with pytest.raises(KFACTypeError, match=r"\.output_shape: input_shape must be an integer"):
        layer.output_shape((2.5, 3))


def test_layer_call_scans_each_array_once(xp, rng, monkeypatch):
    seen = []
    real = B.all_finite
    monkeypatch.setattr(B, "all_finite", lambda ns, a: seen.append(id(a)) or real(ns, a))
    for key in ("dense", "conv-nhwc", "scale-shift"):
        layer, params, x, g = _setup(xp, rng, key)
        named = {"x": x, "g": g, **{f"p{i}": p for i, p in enumerate(params)}}
        seen.clear()
        layer.rvjp(params, x, params, x, g, g)
        counts = collections.Counter(seen)
        # x twice (as x and as dx), g twice (as g and rg), each parameter twice
        # (params and dparams): one scan per argument, no rescans inside the kernels
        assert {k: counts[id(v)] for k, v in named.items()} == {k: 2 for k in named}, key
        seen.clear()
        layer.forward(params, x)
        assert sorted(collections.Counter(seen).values()) == [1] * (1 + len(params)), key


# -- networks -------------------------------------------------------------------------------
def _mlp():
    return nn.Sequential([("fc1", nn.Dense(3, 4)), ("act", nn.Activation("tanh")),
                          ("fc2", nn.Dense(4, 2))])


def _convnet():
    return nn.Sequential([("conv", nn.Conv2D(2, 3, 3, padding="SAME")),
                          ("act", nn.Activation("relu")), ("pool", nn.MeanPool()),
                          ("fc", nn.Dense(3, 2))])


def _net_setup(xp, rng, make, n=4):
    net = make()
    shape = (n, 3) if make is _mlp else (n, 4, 4, 2)
    x = xp.asarray(rng.standard_normal(shape))
    params = net.init_params(np.random.default_rng(2), x if n else xp.asarray(np.zeros(1)))
    g = xp.asarray(rng.standard_normal(net.output_shape(shape)))
    return net, params, x, g


@pytest.mark.parametrize("bad", [None, 3, "fc", [("fc", 3)], [("fc", nn.Dense(2, 2))] * 2, []])
def test_sequential_constructor_refuses_bad_layers(bad):
    with pytest.raises((KFACTypeError, KFACValueError), match=r"^Sequential: "):
        nn.Sequential(bad)


@pytest.mark.parametrize("make", [_mlp, _convnet])
def test_sequential_refuses_a_missing_direction(xp, rng, make):
    net, params, x, g = _net_setup(xp, rng, make)
    with pytest.raises(KFACTypeError, match=r"Sequential\.jvp: dparams must be a flat array"):
        net.jvp(params, x, None)
    fp = net.forward_pass(params, x)
    with pytest.raises(KFACTypeError, match=r"Sequential\.jvp_pass: dparams must be"):
        net.jvp_pass(fp, None)
    with pytest.raises(KFACTypeError, match=r"Sequential\.r_backward_pass: dparams must be"):
        net.r_backward_pass(fp, None, (None,) * len(net), g, g)
    with pytest.raises(KFACTypeError, match=r"second_order_backward: dparams must be"):
        net.second_order_backward(params, x, None, lambda f, fd: (f, fd))
    with pytest.raises(KFACTypeError, match=r"output_cotangents must be a callable"):
        net.second_order_backward(params, x, params, None)


@pytest.mark.parametrize("make", [_mlp, _convnet])
def test_sequential_refuses_string_flags(xp, rng, make):
    net, params, x, g = _net_setup(xp, rng, make)
    with pytest.raises(KFACTypeError, match=r"Sequential\.vjp: per_example must be a bool; "
                                            r"got 'True'"):
        net.vjp(params, x, g, per_example="True")
    fp = net.forward_pass(params, x)
    with pytest.raises(KFACTypeError, match=r"backward_pass: per_example must be a bool"):
        net.backward_pass(fp, g, per_example="True")
    with pytest.raises(KFACTypeError, match=r"Sequential\.flatten: per_example must be a bool"):
        net.flatten(params, per_example=1)


@pytest.mark.parametrize("method", ["forward", "forward_pass", "vjp", "jvp"])
@pytest.mark.parametrize("make", [_mlp, _convnet])
def test_sequential_refuses_bad_inputs(xp, rng, make, method):
    net, params, x, g = _net_setup(xp, rng, make)

    def call(p, xx, gg=g):
        if method == "vjp":
            return net.vjp(p, xx, gg)
        if method == "jvp":
            return net.jvp(p, xx, p)
        return getattr(net, method)(p, xx)

    with pytest.raises(KFACValueError, match=rf"Sequential\.{method}: x must be finite"):
        call(params, _with_nan(xp, x))
    with value_checks(False):
        call(params, _with_nan(xp, x))
    with pytest.raises(KFACTypeError, match=rf"Sequential\.{method}: x must be an array"):
        call(params, np.ones(tuple(x.shape)).tolist())
    with pytest.raises(KFACTypeError, match=r"x must be an array of real floating dtype"):
        call(params, xp.asarray(np.ones(tuple(x.shape), dtype=np.int64)))
    with pytest.raises(KFACTypeError, match=r"x must be an array of real floating dtype"):
        call(params, xp.asarray(np.ones(tuple(x.shape), dtype=bool)))
    w_nan = tuple(tuple(_with_nan(xp, a) if (i, j) == (0, 0) else a for j, a in enumerate(p))
                  for i, p in enumerate(params))
    with pytest.raises(KFACValueError, match=r": params\[0\]|: w must be finite"):
        call(w_nan, x)
    if method == "vjp":
        with pytest.raises(KFACValueError, match=r"Sequential\.vjp: g_out must be finite"):
            call(params, x, _with_nan(xp, g))
    if xp.float64:
        x32 = xp.xp.astype(x, xp.xp.float32)
        with pytest.raises(KFACTypeError, match=r"does not mix precisions"):
            call(params, x32)


def test_a_later_layers_shape_is_checked_for_every_new_input_shape(xp, rng):
    """The shape probes of the later layers are remembered per per-example input shape and
    dtype: after a fitting call, an input whose flattened size does not fit the dense layer
    is still refused, naming that layer, and a fitting one still passes."""
    net = nn.Sequential([("c", nn.Conv2D(2, 3, 3, padding="SAME")), ("f", nn.Flatten()),
                         ("d", nn.Dense(4 * 4 * 3, 2))])
    params = tuple(tuple(xp.asarray(a) for a in p)
                   for p in net.init_params(rng, np.zeros((1, 4, 4, 2))))
    fits = xp.asarray(rng.standard_normal((3, 4, 4, 2)))
    for _ in range(2):  # the second call meets the remembered shape
        assert tuple(net.forward(params, fits).shape) == (3, 2)
        with pytest.raises(KFACValueError, match=r"layer 'd' must receive the shape"):
            net.forward(params, xp.asarray(rng.standard_normal((3, 5, 4, 2))))


def test_sequential_refuses_mixed_precision_in_a_structured_direction(xp, rng):
    if not xp.float64:
        pytest.skip("needs float64 next to float32")
    net, params, x, g = _net_setup(xp, rng, _mlp)
    d32 = tuple(tuple(xp.xp.astype(a, xp.xp.float32) for a in p) for p in params)
    with pytest.raises(KFACTypeError, match=r"Sequential\.jvp: dparams\[0\]\[0\] \(fc1\.w\) "
                                            r"must have the floating dtype"):
        net.jvp(params, x, d32)
    fp = net.forward_pass(params, x)
    with pytest.raises(KFACTypeError, match=r"jvp_pass: dparams\[0\]\[0\] \(fc1\.w\)"):
        net.jvp_pass(fp, d32)


def test_sequential_names_the_layer_of_a_bad_parameter(xp, rng):
    net, params, x, _ = _net_setup(xp, rng, _mlp)
    bad = (params[0], (), (params[2][0], xp.asarray(np.ones(5))))
    with pytest.raises(KFACValueError, match=r"Sequential\.forward: params\[2\]\[1\] \(fc2\.b\) "
                                             r"must be an array of shape \(2\)"):
        net.forward(bad, x)
    with pytest.raises(KFACValueError, match=r"Sequential\.forward: params\[1\] of a "
                                             r"Activation layer must be a tuple of 0 arrays"):
        net.forward((params[0], (x,), params[2]), x)
    with pytest.raises(KFACTypeError, match=r"Sequential\.output_shape: input_shape must be"):
        net.output_shape(None)


@pytest.mark.parametrize("make", [_mlp, _convnet])
def test_empty_batch_gives_empty_outputs_and_zero_sums(xp, rng, make):
    """N = 0: outputs and per-example results have no rows; sums over no examples are
    zero (the oracle: an empty sum)."""
    net, params, x, g = _net_setup(xp, rng, make, n=0)
    out = net.forward(params, x)
    assert tuple(out.shape) == net.output_shape(tuple(x.shape)) and out.shape[0] == 0
    grad = net.vjp(params, x, g)
    assert tuple(grad.shape) == (net.num_params,)
    np.testing.assert_array_equal(xp.to_numpy(grad), np.zeros(net.num_params))
    per = net.vjp(params, x, g, per_example=True)
    assert tuple(per.shape) == (0, net.num_params)
    assert tuple(net.jvp(params, x, params).shape) == tuple(out.shape)
    hv = net.second_order_backward(params, x, params, lambda f, fd: (f, fd))
    np.testing.assert_array_equal(xp.to_numpy(hv), np.zeros(net.num_params))


@pytest.mark.parametrize("make", [_mlp, _convnet])
def test_network_calls_scan_each_array_once(xp, rng, monkeypatch, make):
    """Validated at the door, then run through the layers' unchecked kernels: no layer
    rescans its input, its parameters or the cotangents."""
    net, params, x, g = _net_setup(xp, rng, make)
    seen = []
    real = B.all_finite
    monkeypatch.setattr(B, "all_finite", lambda ns, a: seen.append(id(a)) or real(ns, a))
    flat = [a for p in params for a in p]
    for call, x_n, g_n, p_n in ((lambda: net.forward(params, x), 1, 0, 1),
                                (lambda: net.vjp(params, x, g, per_example=True), 1, 1, 1),
                                (lambda: net.jvp(params, x, params), 1, 0, 2)):
        seen.clear()
        call()  # jvp: the direction is the parameters themselves, checked as params and dparams
        want = collections.Counter({id(x): x_n, **{id(a): p_n for a in flat}})
        if g_n:
            want[id(g)] = g_n
        assert collections.Counter(seen) == want


def test_tap_protocol_scans_only_its_own_arguments(xp, rng, monkeypatch):
    net, params, x, g = _net_setup(xp, rng, _convnet)
    fp = net.forward_pass(params, x)
    seen = []
    real = B.all_finite
    monkeypatch.setattr(B, "all_finite", lambda ns, a: seen.append(id(a)) or real(ns, a))
    net.backward_pass(fp, g, per_example=True)
    assert collections.Counter(seen) == {id(g): 1}
    seen.clear()
    net.stacked_backward_pass(fp, xp.xp.stack([g, g], axis=0))
    assert len(seen) == 1


# -- permutations ---------------------------------------------------------------------------
BAD_PERMS = {
    "short": ([0, 1, 2], KFACValueError, r"of length 4; got shape \(3,\)"),
    "long": ([0, 1, 2, 3, 4], KFACValueError, r"of length 4; got shape \(5,\)"),
    "duplicated": ([0, 1, 1, 3], KFACValueError, r"repeated entries \[1\]"),
    "negative": ([0, 1, -1, 3], KFACValueError, r"out-of-range entries \[-1\]"),
    "too-large": ([0, 1, 4, 3], KFACValueError, r"out-of-range entries \[4\]"),
    "float": ([0.0, 1.0, 2.0, 3.0], KFACTypeError, r"hold integers"),
    "bool": ([True, False, True, False], KFACTypeError, r"hold integers"),
    "nested": ([[0, 1], [2, 3]], KFACValueError, r"of length 4; got shape \(2, 2\)"),
    "string": ("0123", KFACTypeError, r"be a sequence or an array of integers"),
    "none": (None, KFACTypeError, r"be a sequence or an array of integers"),
}


@pytest.mark.parametrize("case", sorted(BAD_PERMS))
def test_permutations_refuse_what_is_not_a_permutation(xp, rng, case):
    perm, exc, msg = BAD_PERMS[case]
    vec = xp.asarray(rng.standard_normal(4))
    mat = xp.asarray(rng.standard_normal((4, 4)))
    with pytest.raises(exc, match=r"permute_vector: perm must .*" + msg):
        nn.permute_vector(vec, perm)
    with pytest.raises(exc, match=r"permute_matrix: perm must .*" + msg):
        nn.permute_matrix(mat, perm)
    if isinstance(perm, list) and case not in ("nested",):
        with pytest.raises(exc, match=r"perm must .*" + msg):
            nn.permute_vector(vec, np.asarray(perm))


def test_permutations_take_host_or_backend_index_arrays(xp, rng):
    host_perm = np.array([2, 0, 3, 1])
    v = rng.standard_normal((3, 4))
    m = rng.standard_normal((4, 4))
    want_v, want_m = xp.round_host(v)[:, host_perm], xp.round_host(m)[host_perm][:, host_perm]
    for perm in (host_perm, host_perm.tolist(), tuple(host_perm), xp.asarray(host_perm)):
        got = nn.permute_vector(xp.asarray(v), perm)
        xp.check(got)
        np.testing.assert_array_equal(xp.to_numpy(got), want_v)
        got = nn.permute_matrix(xp.asarray(m), perm)
        xp.check(got)
        np.testing.assert_array_equal(xp.to_numpy(got), want_m)


def test_backend_permutations_are_checked_on_namespace_device_and_values(xp, rng):
    vec = xp.asarray(rng.standard_normal(4))
    with pytest.raises(KFACValueError, match=r"perm must be a permutation of range\(4\).*"
                                             r"repeated"):
        nn.permute_vector(vec, xp.asarray(np.array([0, 1, 1, 3])))
    # a NumPy perm is checked on the host, an array of another library on its device
    with pytest.raises(KFACTypeError, match=r"perm must (be an array of integral dtype|hold "
                                            r"integers)"):
        nn.permute_vector(vec, xp.asarray(np.array([0.0, 1.0, 2.0, 3.0])))
    with pytest.raises(KFACValueError, match=r"perm must be (an array of shape \(4\)|a "
                                             r"permutation .* of length 4)"):
        nn.permute_vector(vec, xp.asarray(np.array([0, 1, 2])))
    if xp.name == "numpy":
        import array_api_strict

        with pytest.raises(KFACTypeError, match=r"one array namespace"):
            nn.permute_vector(vec, array_api_strict.asarray(np.arange(4)))
        return
    dev = _other_device(xp)
    with pytest.raises(KFACTypeError, match=r"one device"):
        nn.permute_vector(vec, xp.xp.asarray(np.arange(4), device=dev))


def test_permute_matrix_needs_a_square_matrix(xp, rng):
    with pytest.raises(KFACValueError, match=r"permute_matrix: mat must be a square matrix"):
        nn.permute_matrix(xp.asarray(rng.standard_normal((3, 4))), [0, 1, 2])
    with pytest.raises(KFACValueError, match=r"permute_matrix: mat must be finite"):
        nn.permute_matrix(_with_nan(xp, xp.asarray(np.eye(3))), [0, 1, 2])


def test_parameter_derivatives_of_a_network_without_parameters_are_refused(xp, rng):
    """A parameter-free network has no Jacobian to apply: refused by name, not a ``None``
    tangent or an empty concatenation."""
    net = nn.Sequential([("act", nn.Activation("tanh")), ("flat", nn.Flatten())])
    x = xp.asarray(rng.standard_normal((3, 2, 2)))
    xp.assert_close(net.forward(((), ()), x), np.tanh(xp.round_host(
        xp.to_numpy(x))).reshape(3, 4))
    g = xp.asarray(rng.standard_normal((3, 4)))
    for call in (lambda: net.vjp(((), ()), x, g), lambda: net.jvp(((), ()), x, ((), ())),
                 lambda: net.flatten(((), ()))):
        with pytest.raises(KFACValueError, match=r"the network must have parameters"):
            call()


def test_conv_patches_and_layer_check_params(xp, rng):
    layer, params, x, _ = _setup(xp, rng, "conv-nhwc")
    with pytest.raises(KFACValueError, match=r"Conv2D\.patches: x must be finite"):
        layer.patches(_with_nan(xp, x))
    with pytest.raises(KFACValueError, match=r"Conv2D\.patches: x must have C_in = 2"):
        layer.patches(x[..., :1])
    assert tuple(layer.patches(x).shape) == (2, 4, 4, 8)
    if xp.float64:
        b32 = xp.xp.astype(params[1], xp.xp.float32)
        with pytest.raises(KFACTypeError, match=r"f: b must have the floating dtype of w"):
            layer.check_params("f", (params[0], b32))


def test_backward_passes_check_their_caches(xp, rng):
    net, params, x, g = _net_setup(xp, rng, _mlp)
    fp = net.forward_pass(params, x)
    caches = net.vjp_caches(fp)
    grads, _ = net.backward_pass(fp, g, caches=caches)
    want, _ = net.backward_pass(fp, g)
    for a, b in zip(grads, want, strict=True):
        for u, v in zip(a, b, strict=True):
            xp.assert_close(u, xp.to_numpy(v))
    with pytest.raises(KFACTypeError, match=r"backward_pass: caches must be None or the "
                                            r"tuple of vjp_caches"):
        net.backward_pass(fp, g, caches=caches[:2])
    with pytest.raises(KFACValueError, match=r"caches\[0\] must be None \(layer 'fc1'"):
        net.backward_pass(fp, g, caches=(x, *caches[1:]))
    with pytest.raises(KFACValueError, match=r"stacked_backward_pass: caches\[1\] must be an "
                                             r"array of shape \(4, 4\)"):
        net.stacked_backward_pass(fp, g[None, ...], caches=(None, x, None))


def test_permutation_value_check_follows_the_switch(xp, rng):
    """Length and dtype are static checks; whether the entries form a permutation is a
    value check, off under ``value_checks(False)`` (the result is then the plain gather)."""
    v = rng.standard_normal(4)
    with value_checks(False):
        got = nn.permute_vector(xp.asarray(v), [0, 0, 1, 1])
        np.testing.assert_array_equal(xp.to_numpy(got), xp.round_host(v)[[0, 0, 1, 1]])
        with pytest.raises(KFACValueError, match=r"of length 4"):
            nn.permute_vector(xp.asarray(v), [0, 1])


def test_value_checks_skip_traced_arrays():
    """Under ``jax.jit`` the arrays are tracers: static checks still run, value checks
    (finite entries, id range, permutation entries) are skipped."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    layer = nn.Dense(2, 3)
    params = layer.init_params(np.random.default_rng(0), jnp.zeros(1, dtype=jnp.float32))
    x = jnp.asarray(np.array([[np.nan, 1.0]], dtype=np.float32))
    with pytest.raises(KFACValueError, match=r"Dense\.forward: x must be finite"):
        layer.forward(params, x)
    out = jax.jit(layer.forward)(params, x)
    assert np.isnan(np.asarray(out)).all()
    with pytest.raises(KFACValueError, match=r"x must have last axis d_in = 2"):
        jax.jit(layer.forward)(params, jnp.zeros((1, 3), dtype=jnp.float32))
    net = nn.Sequential([("emb", nn.Embedding(4, 2)), ("flat", nn.Flatten())])
    p = net.init_params(np.random.default_rng(0), jnp.zeros(1, dtype=jnp.float32))
    ids = jnp.asarray(np.array([[0, 3]], dtype=np.int32))
    np.testing.assert_array_equal(np.asarray(jax.jit(net.forward)(p, ids)),
                                  np.asarray(net.forward(p, ids)))
    v = jnp.arange(3.0)
    got = jax.jit(nn.permute_vector)(v, jnp.asarray(np.array([2, 0, 1], dtype=np.int32)))
    np.testing.assert_array_equal(np.asarray(got), [2.0, 0.0, 1.0])
