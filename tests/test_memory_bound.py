"""The bound on a convolution's patch temporaries follows the arrays' device, decided in one
place (:func:`kfac_ref.patches.temporary_bytes_bound`): host arrays keep 64 MiB, GPU arrays
(CuPy, torch CUDA) get a share of free device memory, a bound set once with
:func:`kfac_ref.patches.set_max_temporary_bytes` overrides both, an explicit
``max_temporary_bytes`` overrides everything.  Chunking changes only the order of the sums:
statistics and layer passes computed under a tiny process-wide bound equal the one-shot
ones at ``xp.rtol`` (as in tests/test_factors_chunks.py).  The GPU query itself
(``cupy.cuda.Device.mem_info``, ``torch.cuda.mem_get_info``) runs only on a GPU; here its
answer is replaced to test the formula.
"""

from __future__ import annotations

import numpy as np
import pytest

from kfac_ref import KFACValueError, factors, nn, patches

ONE_SHOT = 2**62


@pytest.fixture
def user_bound():
    """Restore the process-wide setting after the test."""
    previous = patches.set_max_temporary_bytes(None)
    yield
    patches.set_max_temporary_bytes(previous)


def test_host_default_explicit_and_user_bound(xp, user_bound):
    x = xp.asarray(np.zeros((2, 3)))
    bound = patches.temporary_bytes_bound(x)
    if xp.name.startswith(("cupy", "torch-cuda")):
        assert bound >= patches.MAX_TEMPORARY_BYTES
    else:
        assert bound == patches.MAX_TEMPORARY_BYTES == 64 * 2**20
    assert patches.temporary_bytes_bound(x, 12345) == 12345
    assert patches.set_max_temporary_bytes(4096) is None
    assert patches.temporary_bytes_bound(x) == 4096
    assert patches.temporary_bytes_bound(x, 12345) == 12345  # the argument wins
    assert patches.set_max_temporary_bytes(None) == 4096


def test_gpu_share_of_free_memory(monkeypatch, user_bound):
    x = np.zeros(3)
    monkeypatch.setattr(patches, "_free_device_bytes", lambda like: 8 * 2**30)
    assert patches.temporary_bytes_bound(x) == int(patches.DEVICE_MEMORY_SHARE * 8 * 2**30)
    monkeypatch.setattr(patches, "_free_device_bytes", lambda like: 10 * 2**20)
    assert patches.temporary_bytes_bound(x) == patches.MAX_TEMPORARY_BYTES  # never below
    patches.set_max_temporary_bytes(999)
    assert patches.temporary_bytes_bound(x) == 999


def test_set_bound_is_checked(user_bound):
    with pytest.raises(KFACValueError, match="set_max_temporary_bytes: nbytes must be an "
                                             "integer >= 1"):
        patches.set_max_temporary_bytes(0)


def test_statistics_and_layer_under_the_set_bound_equal_one_shot(xp, rng, user_bound):
    x = xp.asarray(rng.standard_normal((5, 6, 6, 3)))
    g = xp.asarray(rng.standard_normal((5, 3, 3, 4)))
    conv = dict(filter_shape=(3, 3, 3, 4), padding="SAME", strides=2)
    layer = nn.Conv2D(3, 4, 3, stride=2, padding="SAME")  # max_temporary_bytes from the bound
    params = tuple(xp.asarray(a) for a in layer.init_params(rng, np.zeros(1)))
    one = [factors.conv_input_kronecker_factor(x, **conv, has_bias=True,
                                               max_temporary_bytes=ONE_SHOT),
           factors.conv_output_kronecker_factor(g, max_temporary_bytes=ONE_SHOT),
           nn.Conv2D(3, 4, 3, stride=2, padding="SAME",
                     max_temporary_bytes=ONE_SHOT).forward(params, x)]
    patches.set_max_temporary_bytes(1)  # one example per chunk
    chunked = [factors.conv_input_kronecker_factor(x, **conv, has_bias=True),
               factors.conv_output_kronecker_factor(g), layer.forward(params, x)]
    for c, o in zip(chunked, one, strict=True):
        xp.assert_close(c, xp.to_numpy(o))
