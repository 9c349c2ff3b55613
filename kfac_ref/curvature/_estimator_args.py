"""Argument handling shared by the curvature estimators (internal)."""

from __future__ import annotations

from .._backend import (
    KFACValueError,
    check_array,
    check_array_like,
    check_int,
    check_option,
    check_scalar,
    namespace_of,
)
from ._exact import ESTIMATION_MODES


def unpack_func_args(func, func_args):
    if not (isinstance(func_args, (tuple, list)) and len(func_args) == 2):
        raise KFACValueError(f"{func}: func_args must be (params, batch) with batch = "
                             f"(inputs, targets); got {type(func_args).__name__}.")
    return func_args[0], func_args[1]


VECTOR = "parameter_structured_vector"


def flat_or_structured(func, net, vector, **others):
    """(flat vector, restore) for a flat [P] vector or a parameter structure.

    The members of a structure share one namespace, device and precision with each other
    and with the named ``others`` arrays (``None`` skipped): they are concatenated, and a
    concatenation would otherwise fail inside the array library or promote silently.
    """
    if isinstance(vector, (tuple, list)):
        members = {f"{VECTOR}[{i}][{j}]": a for i, layer in enumerate(vector)
                   if isinstance(layer, (tuple, list)) for j, a in enumerate(layer)}
        if members:
            namespace_of(func, **members, **others)
        vector = net.check_params(func, vector, VECTOR)
        return net.flatten(vector), net.unflatten
    likes = [(k, a) for k, a in others.items() if a is not None]
    if len(likes) == 1:  # a state's array: one call checks the vector against it
        check_array_like(func, VECTOR, vector, *likes[0], shape=(net.num_params,),
                         layout="[P]")
        return vector, _same
    check_array(func, VECTOR, vector, shape=(net.num_params,), layout="[P]")
    if likes:
        namespace_of(func, **{VECTOR: vector}, **others)
    return vector, _same


def _same(v):
    return v


class EstimatorBase:
    """Checks of the estimation mode, EMA weights and batch size."""

    def _check_mode(self, func, mode):
        mode = self.default_estimation_mode if mode is None else mode
        return check_option(func, "estimation_mode", mode, ESTIMATION_MODES)

    def _check_ema(self, func, ema_old, ema_new, like=None):
        """The EMA weights; ``like``: the state's arrays they are averaged into (0-D
        weights must share their namespace, device and precision)."""
        return (check_scalar(func, "ema_old", ema_old, nonnegative=True, like=like),
                check_scalar(func, "ema_new", ema_new, nonnegative=True, like=like))

    def _check_batch_size(self, func, batch_size, n):
        bs = check_int(func, "batch_size", batch_size, minimum=1)
        if bs != n:
            raise KFACValueError(f"{func}: batch_size must equal the number of examples in "
                                 f"func_args ({n}); got {bs}.")
        return bs
