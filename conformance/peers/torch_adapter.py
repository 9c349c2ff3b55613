"""Shared plumbing of the PyTorch peer adapters (BackPACK, ASDL, nngeometry): the network
spec as an ``nn.Sequential`` and a per-layer block-diagonal assembly.  Imports torch lazily."""

from __future__ import annotations

import numpy as np

from ..adapter import AdapterUnavailable


def require(*modules, environment="conformance/peers/torchpeers.txt"):
    """Import ``modules``; a missing one is ``AdapterUnavailable`` pointing to ``environment``."""
    import importlib

    for m in modules:
        try:
            importlib.import_module(m)
        except ImportError as exc:
            raise AdapterUnavailable(
                f"{m} is not installed ({exc}); see {environment}"
            ) from exc


def problem(inputs, params):
    from . import nets

    model, x, pmods = nets.torch_build(params["net"], inputs)
    nets.check_forward_torch(model, x, params["net"], inputs)
    return model, x, nets.torch_targets(params, inputs), pmods


def kron_blocks(pairs, separate_bias):
    """Dense K-FAC matrix from per-layer (G, A, has_bias) in PyTorch parameter order:
    ``kron(G, A)`` for the weight and ``G`` for a separate bias block."""
    from . import nets

    blocks = []
    for g, a, has_bias in pairs:
        kw = np.kron(g, a)
        if has_bias and separate_bias:
            blk = np.zeros((kw.shape[0] + g.shape[0],) * 2)
            blk[: kw.shape[0], : kw.shape[0]] = kw
            blk[kw.shape[0] :, kw.shape[0] :] = g
            blocks.append(blk)
        else:
            blocks.append(kw)
    return nets.block_diag(blocks)
