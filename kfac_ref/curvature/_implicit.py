r"""The matrix-free exact estimator (kfac-jax ``ImplicitExactCurvature``); documented in
:mod:`kfac_ref.curvature`."""

from __future__ import annotations

from .._backend import KFACValueError, check_array, check_option, namespace_of
from .._support import capabilities
from . import _exact as exact
from ._estimator_args import flat_or_structured, unpack_func_args


# ------------------------------------------------------------------------------------------
# Implicit exact curvature
# ------------------------------------------------------------------------------------------
@capabilities(dask="yes")
class ImplicitExactCurvature:
    r"""Matrix-free exact curvature products (kfac-jax ``ImplicitExactCurvature``).

    .. math::

        &Hv,\quad Gv = \tfrac1N\textstyle\sum_n J_n^\top G_n J_n v,\quad
        Fv = \tfrac1N\textstyle\sum_n J_n^\top F_n J_n v,

        &\mathcal B u = \tfrac{1}{\sqrt N}\textstyle\sum_n J_n^\top B_n u_n,\quad
        \mathcal B^\top v = [\tfrac{1}{\sqrt N} B_n^\top J_n v]_n .

    A thin class over the exact curvature products of :mod:`kfac_ref.curvature`.

    Parameters
    ----------
    net : kfac_ref.nn.Sequential
    loss_fn : loss class or callable ``(outputs, targets) -> LossFunction``
    """

    def __init__(self, net, loss_fn):
        self.net = net
        self.loss_fn = loss_fn

    def _call(self, name, fn, func_args, vector, *extra):
        params, batch = unpack_func_args(f"ImplicitExactCurvature.{name}", func_args)
        flat, back = flat_or_structured(f"ImplicitExactCurvature.{name}", self.net, vector)
        return back(fn(self.net, self.loss_fn, params, batch, flat, *extra))

    def batch_size(self, func_args):
        r"""Number of examples of the batch (``inputs.shape[0]``).

        .. math:: N
        """
        _, batch = unpack_func_args("ImplicitExactCurvature.batch_size", func_args)
        return int(batch[0].shape[0])

    def multiply_hessian(self, func_args, parameter_structured_vector):
        r"""Exact Hessian product (R-operator; :func:`~kfac_ref.curvature.hessian_vector_product`).

        .. math:: \nabla^2_\theta\mathcal L\, v
        """
        return self._call("multiply_hessian", exact.hessian_vector_product, func_args,
                          parameter_structured_vector)

    def multiply_ggn(self, func_args, parameter_structured_vector):
        r"""GGN product.

        .. math:: Gv = \frac1N\sum_n J_n^\top G_n J_n v
        """
        return self._call("multiply_ggn", exact.ggn_vector_product, func_args,
                          parameter_structured_vector)

    def multiply_fisher(self, func_args, parameter_structured_vector):
        r"""Exact Fisher product.

        .. math:: Fv = \frac1N\sum_n J_n^\top F_n J_n v
        """
        return self._call("multiply_fisher", exact.fisher_vector_product, func_args,
                          parameter_structured_vector)

    def multiply_fisher_factor_transpose(self, func_args, parameter_structured_vector):
        r"""Transposed Fisher factor (returns ``(array,)``: one entry per loss, as kfac-jax).

        .. math:: \mathcal B^\top v = [B_n^\top J_n v/\sqrt N]_n,\qquad
            \mathcal B\mathcal B^\top = F
        """
        params, batch = unpack_func_args("multiply_fisher_factor_transpose", func_args)
        flat, _ = flat_or_structured("multiply_fisher_factor_transpose", self.net,
                                      parameter_structured_vector)
        return (exact.fisher_factor_transpose_product(self.net, self.loss_fn, params, batch, flat),)

    def multiply_ggn_factor_transpose(self, func_args, parameter_structured_vector):
        r"""Transposed GGN factor (a 1-tuple).

        .. math:: \mathcal B^\top v,\qquad \mathcal B\mathcal B^\top = G
        """
        params, batch = unpack_func_args("multiply_ggn_factor_transpose", func_args)
        flat, _ = flat_or_structured("multiply_ggn_factor_transpose", self.net,
                                      parameter_structured_vector)
        return (exact.ggn_factor_transpose_product(self.net, self.loss_fn, params, batch, flat),)

    def _inner(self, func, loss_inner_vectors):
        if isinstance(loss_inner_vectors, (tuple, list)):
            if len(loss_inner_vectors) != 1:
                raise KFACValueError(f"{func}: loss_inner_vectors must hold one array (one "
                                     f"loss); got {len(loss_inner_vectors)}.")
            return loss_inner_vectors[0]
        return loss_inner_vectors

    def multiply_fisher_factor(self, func_args, loss_inner_vectors):
        r"""Fisher factor times loss-inner vectors (flat [P]).

        .. math:: \mathcal B u = \frac{1}{\sqrt N}\sum_n J_n^\top B_n u_n
        """
        func = "ImplicitExactCurvature.multiply_fisher_factor"
        params, batch = unpack_func_args(func, func_args)
        return exact.fisher_factor_product(self.net, self.loss_fn, params, batch,
                                       self._inner(func, loss_inner_vectors))

    def multiply_ggn_factor(self, func_args, loss_inner_vectors):
        r"""GGN factor times loss-inner vectors (flat [P]).

        .. math:: \mathcal B u,\qquad \mathcal B\mathcal B^\top = G
        """
        func = "ImplicitExactCurvature.multiply_ggn_factor"
        params, batch = unpack_func_args(func, func_args)
        return exact.ggn_factor_product(self.net, self.loss_fn, params, batch,
                                    self._inner(func, loss_inner_vectors))

    def multiply_jacobian(self, func_args, parameter_structured_vector,
                          return_loss_objects=False):
        r""":math:`J v` as the loss's inputs: ``((dep_1, ...),)`` (one tuple per loss).

        .. math:: (J v)_n = J_n v
        """
        func = "ImplicitExactCurvature.multiply_jacobian"
        params, batch = unpack_func_args(func, func_args)
        flat, _ = flat_or_structured(func, self.net, parameter_structured_vector)
        b = exact.evaluate_batch(func, self.net, self.loss_fn, params, batch)
        exact.check_flat_vector(func, b, flat)
        out = (b.as_tuple(b.jvp_flat(flat)),)
        return (out, (b.loss,)) if return_loss_objects else out

    def multiply_jacobian_transpose(self, func_args, loss_input_vectors,
                                    return_loss_objects=False):
        r""":math:`J^\top u = \sum_n J_n^\top u_n` for ``loss_input_vectors = ((dep_1, ...),)``.

        .. math:: J^\top u = \textstyle\sum_n J_n^\top u_n \quad(\text{no } 1/N)
        """
        func = "ImplicitExactCurvature.multiply_jacobian_transpose"
        params, batch = unpack_func_args(func, func_args)
        b = exact.evaluate_batch(func, self.net, self.loss_fn, params, batch)
        if not (isinstance(loss_input_vectors, (tuple, list)) and len(loss_input_vectors) == 1
                and isinstance(loss_input_vectors[0], (tuple, list))
                and len(loss_input_vectors[0]) == len(b.dep_shapes)):
            raise KFACValueError(f"{func}: loss_input_vectors must be ((v_1, ...),) with one "
                                 f"array per loss input {b.dep_shapes}; got "
                                 f"{type(loss_input_vectors).__name__}.")
        vecs = loss_input_vectors[0]
        for i, (v, s) in enumerate(zip(vecs, b.dep_shapes, strict=True)):
            namespace_of(func, x=b.out, **{f"loss_input_vectors[0][{i}]": v})
            check_array(func, f"loss_input_vectors[0][{i}]", v, shape=s)
        out = b.vjp(b.flat(vecs))
        return (out, (b.loss,)) if return_loss_objects else out

    def get_loss_inner_vector_shapes_and_batch_size(self, func_args, mode):
        r"""``((inner_shape,), N)`` for ``mode`` in {"fisher", "ggn"}.

        .. math:: u \in \mathbb R^{N \times K\dots},\quad B_n \in \mathbb R^{D\times K}
        """
        func = "ImplicitExactCurvature.get_loss_inner_vector_shapes_and_batch_size"
        check_option(func, "mode", mode, ("fisher", "ggn"))
        params, batch = unpack_func_args(func, func_args)
        b = exact.evaluate_batch(func, self.net, self.loss_fn, params, batch)
        if mode == "fisher":
            exact.require_negative_log_prob(func, b, "the Fisher factor")
        shape = (b.loss.fisher_factor_inner_shape if mode == "fisher"
                 else b.loss.ggn_factor_inner_shape)
        return (tuple(shape),), b.n

    def get_loss_input_shapes_and_batch_size(self, func_args):
        r"""``((shapes of the loss inputs,),), N``.

        .. math:: f_n \in \mathbb R^{D}
        """
        func = "ImplicitExactCurvature.get_loss_input_shapes_and_batch_size"
        params, batch = unpack_func_args(func, func_args)
        b = exact.evaluate_batch(func, self.net, self.loss_fn, params, batch)
        return (b.dep_shapes,), b.n


