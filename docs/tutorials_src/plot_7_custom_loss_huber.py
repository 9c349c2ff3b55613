r"""
A loss of your own: Huber regression, K-FAC against the exact GGN
=================================================================

kfac_ref's five built-in losses are negative log-likelihoods.  Many losses are not: robust
regression uses the Huber loss, physics-informed training a squared residual.  K-FAC and the
exact generalised Gauss-Newton matrix (GGN) need only two things from a loss, per example:
its gradient in the network output and a square root :math:`B_n` of its Hessian there
(:doc:`/theory/losses`, section *A loss of your own*).  This tutorial

1. writes the Huber loss as a :class:`~kfac_ref.losses.CustomLoss` from three NumPy
   functions and checks its Hessian square root against finite differences;
2. builds the K-FAC approximation of a small network's GGN with the block-diagonal
   estimator and compares it with the exact GGN, block by block: exact for one example,
   approximate otherwise;
3. shows what is particular to Huber: examples whose residual is in the linear piece add no
   curvature at all.
"""

# %%
# The Huber loss and its three functions
# --------------------------------------
# Per output coordinate, with residual :math:`r = f - y` and threshold :math:`\delta`,
#
# .. math::
#
#    \ell(r) = \begin{cases} \tfrac12 r^2 & |r| \le \delta \\
#                            \delta\,(|r| - \tfrac12\delta) & |r| > \delta \end{cases},
#    \qquad \ell'(r) = \operatorname{clip}(r, -\delta, \delta),
#    \qquad \ell''(r) = [\,|r| \le \delta\,].
#
# The Hessian in the output is diagonal with 0/1 entries, so it is its own square root:
# :math:`B_n = \operatorname{diag}([\,|r_n| \le \delta\,])`, shape ``[N, D, D]``.  The
# functions take the whole batch ``(outputs [N, D], targets [N, D])``; kfac_ref checks what
# they return (shape, dtype, finiteness) and multiplies by the loss weight itself.
import matplotlib.pyplot as plt
import numpy as np

from kfac_ref import curvature, losses, nn

DELTA = 0.5


def huber_value(f, y):  # [N]
    a = np.abs(f - y)
    return np.sum(np.where(a <= DELTA, 0.5 * a * a, DELTA * (a - 0.5 * DELTA)), axis=-1)


def huber_gradient(f, y):  # like f
    return np.clip(f - y, -DELTA, DELTA)


def huber_hessian_sqrt(f, y):  # [N, D, D]
    inside = (np.abs(f - y) <= DELTA).astype(f.dtype)
    return inside[:, :, None] * np.eye(f.shape[1])[None, :, :]


def huber(outputs, targets):
    return losses.CustomLoss(outputs, targets, value=huber_value, gradient=huber_gradient,
                             hessian_sqrt=huber_hessian_sqrt)


# %%
# A first check: :math:`B_nB_n^\top` against central differences of the gradient, on random
# outputs away from the kinks at :math:`|r| = \delta` (where :math:`\ell''` jumps).
rng = np.random.default_rng(0)
f0, y0 = rng.standard_normal((5, 3)), rng.standard_normal((5, 3))
h = 1e-6
fd = np.stack([(huber_gradient(f0 + h * e, y0) - huber_gradient(f0 - h * e, y0)) / (2 * h)
               for e in np.eye(3)[:, None, :]], axis=-1)  # [N, D, D]
loss = huber(f0, y0)
print("max |B Bᵀ − finite differences|:", np.abs(loss.ggn_matrix() - fd).max())

# %%
# A small network, exact GGN and K-FAC
# ------------------------------------
# Two ``tanh`` layers, 4 inputs, 3 outputs.  :func:`~kfac_ref.curvature.ggn_matrix`
# forms :math:`\frac1N\sum_n J_n^\top B_nB_n^\top J_n` from the network's Jacobian and the
# loss's square roots; the block-diagonal estimator's ``"ggn_exact"`` mode back-propagates
# the columns of :math:`B_n` and builds the two Kronecker factors of every dense layer.
net = nn.Sequential([("dense1", nn.Dense(4, 8)), ("act1", nn.Activation("tanh")),
                     ("dense2", nn.Dense(8, 8)), ("act2", nn.Activation("tanh")),
                     ("dense3", nn.Dense(8, 3))])
params = net.init_params(rng, np.zeros(1))
dense = [i for i, name in enumerate(net.names) if name.startswith("dense")]
slices = net.layer_slices()


def targets_with_outliers(x):
    # the network's own prediction plus small noise, and a few gross errors
    clean = np.asarray(net.forward(params, x)) + 0.2 * rng.standard_normal((x.shape[0], 3))
    outlier = rng.random((x.shape[0], 3)) < 0.2
    return np.where(outlier, clean + 3.0 * rng.standard_normal(clean.shape), clean)


def block_errors(x, y):
    exact = curvature.ggn_matrix(net, huber, params, (x, y))
    est = curvature.BlockDiagonalCurvature(net, huber)
    state = est.init(None, (params, (x, y)))
    state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, x.shape[0], None,
                                                 (params, (x, y)), "ggn_exact")
    kfac = np.asarray(est.to_dense_matrix(state))
    return {net.names[i]: np.linalg.norm(kfac[slices[i], slices[i]]
                                         - exact[slices[i], slices[i]])
            / max(np.linalg.norm(exact[slices[i], slices[i]]), 1e-300) for i in dense}, exact


# %%
# One example: K-FAC is exact
# ---------------------------
# With :math:`N = 1` each factor is one outer product and the Kronecker product of the two
# averages is the average of the Kronecker products, for any loss (take an example whose
# residuals are inside the quadratic piece, or its curvature is zero).
x1 = 0.1 * rng.standard_normal((1, 4))
y1 = np.asarray(net.forward(params, x1)) + 0.1
errors, _ = block_errors(x1, y1)
for name, err in errors.items():
    print(f"N = 1, {name}: relative error {err:.1e}")

# %%
# Larger batches: K-FAC approximates
# ----------------------------------
# With many examples, 20 % of whose targets are outliers, the per-layer relative Frobenius
# error of K-FAC's blocks; the last layer is no longer exact, unlike with a squared error,
# because :math:`B_n` now differs between examples (0 or 1 per coordinate).
batch_sizes = [1, 2, 4, 8, 16, 32, 64, 128]
curves = {net.names[i]: [] for i in dense}
for n in batch_sizes:
    x = rng.standard_normal((n, 4))
    errors, _ = block_errors(x, targets_with_outliers(x))
    for name, err in errors.items():
        curves[name].append(err)

fig, ax = plt.subplots(figsize=(7, 4))
for name, errs in curves.items():
    ax.semilogx(batch_sizes, errs, "o-", label=name)
ax.set_xlabel("batch size N")
ax.set_ylabel(r"$\|A\otimes G - \mathrm{GGN}_{ll}\|_F / \|\mathrm{GGN}_{ll}\|_F$")
ax.set_title("K-FAC of a Huber loss against its exact GGN")
ax.legend()
fig.tight_layout()

# %%
# Outliers carry no curvature
# ---------------------------
# A coordinate whose residual is beyond :math:`\delta` has :math:`\ell'' = 0`: it adds to
# the gradient (a bounded amount, :math:`\pm\delta`) but nothing to the GGN.  Dropping those
# coordinates from a squared-error loss gives the same GGN: the Huber GGN is the squared-error
# GGN of the inliers.
x = rng.standard_normal((64, 4))
y = targets_with_outliers(x)
_, ggn_huber = block_errors(x, y)
f = np.asarray(net.forward(params, x))
inlier = (np.abs(f - y) <= DELTA).astype(float)


def masked_squared_error(outputs, targets):
    return losses.CustomLoss(
        outputs, targets, value=lambda f, y: 0.5 * np.sum(inlier * (f - y) ** 2, axis=-1),
        gradient=lambda f, y: inlier * (f - y),
        hessian_sqrt=lambda f, y: inlier[:, :, None] * np.eye(3)[None, :, :])


ggn_inliers = curvature.ggn_matrix(net, masked_squared_error, params, (x, y))
print("fraction of coordinates in the quadratic piece:", inlier.mean())
print("max |GGN(Huber) − GGN(squared error on the inliers)|:",
      np.abs(ggn_huber - ggn_inliers).max())

# %%
# The same loss by automatic differentiation
# ------------------------------------------
# With PyTorch or JAX arrays, :class:`~kfac_ref.losses.AutodiffLoss` needs only the loss of
# one example; it forms the gradient and the Hessian with the library's ``vmap`` of ``grad``
# and ``hessian`` and the square root by one batched eigendecomposition.  This cell runs
# where PyTorch is installed.
try:
    import torch
except ImportError:
    torch = None

if torch is not None:
    def huber_one(output, target):
        a = torch.abs(output - target)
        return torch.sum(torch.where(a <= DELTA, 0.5 * a * a, DELTA * (a - 0.5 * DELTA)))

    auto = losses.AutodiffLoss(torch.asarray(f0), torch.asarray(y0), loss=huber_one)
    print("max |GGN by autodiff − by hand|:",
          np.abs(auto.ggn_matrix().numpy() - loss.ggn_matrix()).max())
plt.show()
