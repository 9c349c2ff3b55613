"""Argument handling shared by the curvature estimators (internal)."""

from __future__ import annotations

from .._backend import (
    KFACValueError,
    check_array,
    check_int,
    check_option,
    check_scalar,
)
from .exact import ESTIMATION_MODES

__all__ = ["EstimatorBase", "unpack_func_args", "flat_or_structured"]


def unpack_func_args(func, func_args):
    if not (isinstance(func_args, (tuple, list)) and len(func_args) == 2):
        raise KFACValueError(f"{func}: func_args must be (params, batch) with batch = "
                             f"(inputs, targets); got {type(func_args).__name__}.")
    return func_args[0], func_args[1]


def flat_or_structured(func, net, vector):
    """(flat vector, restore) for a flat [P] vector or a parameter structure."""
    if isinstance(vector, (tuple, list)):
        vector = net.check_params(func, vector)
        return net.flatten(vector), net.unflatten
    check_array(func, "parameter_structured_vector", vector, shape=(net.num_params,),
                layout="[P]")
    return vector, lambda v: v




class EstimatorBase:
    """Checks of the estimation mode, EMA weights and batch size."""

    def _check_mode(self, func, mode):
        mode = self.default_estimation_mode if mode is None else mode
        return check_option(func, "estimation_mode", mode, ESTIMATION_MODES)

    def _check_ema(self, func, ema_old, ema_new):
        return (check_scalar(func, "ema_old", ema_old, nonnegative=True),
                check_scalar(func, "ema_new", ema_new, nonnegative=True))

    def _check_batch_size(self, func, batch_size, n):
        bs = check_int(func, "batch_size", batch_size, minimum=1)
        if bs != n:
            raise KFACValueError(f"{func}: batch_size must equal the number of examples in "
                                 f"func_args ({n}); got {bs}.")
        return bs
