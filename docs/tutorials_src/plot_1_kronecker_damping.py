r"""
Kronecker products, vec conventions and damping
===============================================

K-FAC approximates the curvature block of a dense layer by a Kronecker product
:math:`A \otimes G` of two small matrices, and preconditions with a *damped* inverse of it.
This tutorial checks, on arrays small enough to print, the three facts that an
implementation most often gets wrong:

1. which flattening of the weight matrix :math:`A \otimes G` acts on (and when it is
   :math:`G \otimes A` instead);
2. why the damping is split between the factors with the trace-norm :math:`\pi`;
3. how far factored damping is from exact damping :math:`(A \otimes G + \lambda I)^{-1}`.

It uses only :mod:`kfac_ref.linalg`, NumPy and Matplotlib.
"""

# %%
# The two factors of a dense layer
# --------------------------------
# A dense layer with ``d_in = 4`` inputs and ``d_out = 3`` outputs sees a batch of
# ``N = 64`` inputs ``a`` and back-propagated vectors ``g``.  We give the two factors very
# different scales on purpose (inputs of order 10, gradients of order 0.01), as in real
# networks, because that is where the damping split matters.
import matplotlib.pyplot as plt
import numpy as np

import kfac_ref

rng = np.random.default_rng(0)
N, d_in, d_out = 64, 4, 3
mix_a = rng.standard_normal((d_in, d_in)) * np.array([10.0, 5.0, 1.0, 0.5])
a = rng.standard_normal((N, d_in)) @ mix_a.T
g = 0.01 * rng.standard_normal((N, d_out)) @ rng.standard_normal((d_out, d_out))

A = kfac_ref.compute_cov(kfac_ref.append_homog(a))  # [d_in + 1, d_in + 1], bias last
G = kfac_ref.compute_cov(g)  # [d_out, d_out]
print("A:", A.shape, " G:", G.shape)
print("average eigenvalue of A:", np.trace(A) / A.shape[0])
print("average eigenvalue of G:", np.trace(G) / G.shape[0])

# %%
# Which vector does ``kron(A, G)`` act on?
# ----------------------------------------
# Let :math:`V` be a gradient shaped like the combined parameter matrix :math:`[W; b]`,
# ``[d_in + 1, d_out]`` (TensorFlow/JAX kernel layout).  With the row-major flattening
# :math:`\operatorname{vec}_r` (NumPy's ``reshape(-1)``),
#
# .. math::
#
#    (A \otimes G)\, \operatorname{vec}_r(V) = \operatorname{vec}_r(A V G^\top).
#
# :func:`~kfac_ref.linalg.kron_matvec` computes the right-hand side; the dense
# :func:`~kfac_ref.linalg.kron` is the oracle.
V = rng.standard_normal((d_in + 1, d_out))
dense = kfac_ref.kron(A, G) @ V.reshape(-1)
fast = kfac_ref.kron_matvec(A, G, V)
print("kron_matvec vs kron, row-major:", np.max(np.abs(fast.reshape(-1) - dense)))

# %%
# PyTorch stores the same weights transposed, ``[d_out, d_in + 1]``, and flattens them
# row-major too.  Row-major flattening of the transpose is the column-major flattening
# :math:`\operatorname{vec}_c` of the papers, and
# :math:`(A \otimes G)\operatorname{vec}_c(U) = \operatorname{vec}_c(G U A^\top)` for
# :math:`U = V^\top`; ``order="F"`` reads the matrix that way.  Flattening ``V.T`` row-major
# and multiplying by ``kron(A, G)`` is the classic mistake: in that order the block is
# ``kron(G, A)``.
U = V.T  # PyTorch layout [d_out, d_in + 1]
print(
    "order='F' on the PyTorch layout:",
    np.max(np.abs(kfac_ref.kron_matvec(A, G, U, order="F") - dense.reshape(V.shape).T)),
)
wrong = kfac_ref.kron(A, G) @ U.reshape(-1)
right = kfac_ref.kron(G, A) @ U.reshape(-1)
print(
    "kron(A, G) @ U.flatten() vs the true product, relative error:",
    np.linalg.norm(wrong - dense.reshape(V.shape).T.reshape(-1)) / np.linalg.norm(dense),
)
print(
    "kron(G, A) @ U.flatten() vs the true product, relative error:",
    np.linalg.norm(right - dense.reshape(V.shape).T.reshape(-1)) / np.linalg.norm(dense),
)

# %%
# The π split of the damping
# --------------------------
# Adding :math:`\lambda I` to :math:`A \otimes G` destroys the Kronecker structure.
# Factored damping adds :math:`\pi\sqrt\lambda\, I` to :math:`A` and
# :math:`\frac{\sqrt\lambda}{\pi} I` to :math:`G` instead:
#
# .. math::
#
#    (A + \pi\sqrt\lambda I) \otimes (G + \tfrac{\sqrt\lambda}{\pi} I)
#    = A \otimes G + \lambda I + \underbrace{\pi\sqrt\lambda\, I \otimes G
#      + \tfrac{\sqrt\lambda}{\pi}\, A \otimes I}_{R(\pi)} .
#
# Every :math:`\pi > 0` gives the exact :math:`\lambda I` term; :math:`\pi` only moves the
# residual :math:`R(\pi)` between the two factors.  Its trace,
# :math:`\operatorname{tr} R(\pi) = \sqrt\lambda\,(\pi \dim A \operatorname{tr} G
# + \pi^{-1} \dim G \operatorname{tr} A)`, is smallest at the trace-norm
# :math:`\pi = \sqrt{(\operatorname{tr}A/\dim A)/(\operatorname{tr}G/\dim G)}` returned by
# :func:`~kfac_ref.linalg.pi_tracenorm`.  We evaluate the residual densely for a range of
# :math:`\pi` and mark that value.
lam = 1e-3
d_a, d_g = A.shape[0], G.shape[0]
I_a, I_g = np.eye(d_a), np.eye(d_g)
target = kfac_ref.kron(A, G) + lam * np.eye(d_a * d_g)


def residual(pi):
    root = np.sqrt(lam)
    damped = kfac_ref.kron(A + pi * root * I_a, G + root / pi * I_g)
    return damped - target


pis = np.logspace(-1, 4, 1500)
trace_res = np.array([np.trace(residual(p)) for p in pis])
fro_res = np.array([np.linalg.norm(residual(p)) for p in pis])
pi_tr = kfac_ref.pi_tracenorm(A, G)
pi_fro = np.sqrt(kfac_ref.factor_norm(A, "avg_fro") / kfac_ref.factor_norm(G, "avg_fro"))
print(f"trace-norm pi = {pi_tr:.4g}; grid minimiser of tr R = {pis[np.argmin(trace_res)]:.4g}")
print(
    f"pi from avg_fro norms = {pi_fro:.4g}; "
    f"grid minimiser of ||R||_F = {pis[np.argmin(fro_res)]:.4g}"
)

fig, ax = plt.subplots(figsize=(7, 4))
ax.loglog(pis, trace_res, label=r"$\mathrm{tr}\,R(\pi)$")
ax.loglog(pis, fro_res, label=r"$\|R(\pi)\|_F$")
ax.axvline(pi_tr, color="C0", ls="--", label=r"pi_tracenorm (trace norm)")
ax.axvline(pi_fro, color="C1", ls=":", label=r"$\pi$ from avg_fro norms")
ax.axvline(1.0, color="grey", ls="-.", label=r"$\pi = 1$ (no split)")
ax.set_xlabel(r"$\pi$")
ax.set_ylabel("size of the residual")
ax.set_title(rf"Residual of factored damping, $\lambda = {lam:g}$")
ax.legend()
fig.tight_layout()

# %%
# The trace is minimised exactly at the trace-norm :math:`\pi`.  The Frobenius norm has its
# own minimiser, close to the :math:`\pi` built from kfac-jax's ``avg_fro`` norms (that
# :math:`\pi` minimises an upper bound, not the norm itself).  :math:`\pi = 1`, which adds
# :math:`\sqrt\lambda` to both factors, is far off when the factors have different scales.
#
# Factored versus exact damping: spectra
# --------------------------------------
# How different are the two damped matrices?  Their eigenvalues are all products of
# factor eigenvalues: :math:`(s_A + \pi\sqrt\lambda)(s_G + \sqrt\lambda/\pi)` for factored
# damping and :math:`s_A s_G + \lambda` for exact damping.  The gap is the residual
# :math:`R(\pi)`, which is largest in the directions where one factor is small and the
# other large.  We also show the "unsplit" pitfall :math:`(A + \lambda I)\otimes(G+\lambda I)`,
# whose effective damping depends on the scale of the factors.
lam = 1e-4
left, right = kfac_ref.pi_adjusted_damping(A, G, lam)
s_a = np.linalg.eigvalsh(A)
s_g = np.linalg.eigvalsh(G)
undamped = np.sort(np.outer(s_a, s_g).ravel())[::-1]
exact = np.sort(np.outer(s_a, s_g).ravel() + lam)[::-1]
factored = np.sort(np.outer(s_a + left, s_g + right).ravel())[::-1]
unsplit = np.sort(np.outer(s_a + lam, s_g + lam).ravel())[::-1]

# The closed forms agree with the dense matrices.
dense_factored = kfac_ref.kron(A + left * I_a, G + right * I_g)
print(
    "factored spectrum, closed form vs dense:",
    np.max(np.abs(np.sort(np.linalg.eigvalsh(dense_factored))[::-1] - factored)),
)

fig, ax = plt.subplots(figsize=(7, 4))
k = np.arange(1, undamped.size + 1)
ax.semilogy(k, np.maximum(undamped, 1e-16), "k.", label=r"$A\otimes G$ (undamped)")
ax.semilogy(k, exact, "o", mfc="none", label=r"exact: $A\otimes G + \lambda I$")
ax.semilogy(k, factored, "x", label=r"factored, trace-norm $\pi$")
ax.semilogy(k, unsplit, "+", label=r"unsplit: $(A+\lambda I)\otimes(G+\lambda I)$")
ax.axhline(lam, color="grey", ls=":", label=r"$\lambda$")
ax.set_xlabel("eigenvalue index (descending)")
ax.set_ylabel("eigenvalue")
ax.set_title(rf"Spectra of the damped block, $\lambda = {lam:g}$")
ax.legend(fontsize="small")
fig.tight_layout()

# %%
# Both dampings lift the small eigenvalues above :math:`\lambda`; factored damping lifts
# them further, because of the residual.  The unsplit version barely damps at all here:
# :math:`\lambda` added to :math:`G` (eigenvalues of order :math:`10^{-4}`) is significant,
# while added to :math:`A` (order :math:`10^2`) it is negligible, so its effective damping
# is decided by the factor scales rather than by :math:`\lambda`.
#
# Factored versus exact damping: the preconditioned gradient
# ----------------------------------------------------------
# Finally the quantity an optimiser uses: the damped inverse applied to a gradient, computed
# by :func:`~kfac_ref.linalg.kron_damped_inverse_matvec` in both styles, against a dense
# solve.
lams = np.logspace(-14, 0, 57)
err_exact, err_factored = [], []
for lam in lams:
    oracle = np.linalg.solve(kfac_ref.kron(A, G) + lam * np.eye(d_a * d_g), V.reshape(-1))
    ex = kfac_ref.kron_damped_inverse_matvec(A, G, V, damping=lam, damping_method="exact")
    fa = kfac_ref.kron_damped_inverse_matvec(A, G, V, damping=lam)
    err_exact.append(np.linalg.norm(ex.reshape(-1) - oracle) / np.linalg.norm(oracle))
    err_factored.append(np.linalg.norm(fa.reshape(-1) - oracle) / np.linalg.norm(oracle))

fig, ax = plt.subplots(figsize=(7, 4))
ax.loglog(lams, np.maximum(err_exact, 1e-17), "o-", ms=3, label="exact damping")
ax.loglog(lams, err_factored, "x-", ms=3, label=r"factored damping (trace-norm $\pi$)")
ax.set_xlabel(r"damping $\lambda$")
ax.set_ylabel(r"relative distance to $(A\otimes G+\lambda I)^{-1}v$")
ax.set_title("Damped Kronecker inverse applied to a gradient")
ax.legend()
fig.tight_layout()

# %%
# Exact damping reproduces the dense solve to rounding error for every :math:`\lambda`
# (the error that remains grows with the condition number of
# :math:`A \otimes G + \lambda I`).  Factored damping is a different preconditioner: its
# distance to the exact one shrinks only like :math:`\sqrt\lambda` as
# :math:`\lambda \to 0`, and it is of order one as soon as :math:`\pi\sqrt\lambda` or
# :math:`\sqrt\lambda/\pi` is comparable to the smallest eigenvalue of :math:`A` or
# :math:`G` — here already for :math:`\lambda \approx 10^{-8}`.  For large :math:`\lambda`
# both tend to :math:`v/\lambda` and the distance falls again.  K-FAC uses it anyway: its
# inverse is a Kronecker product of two small inverses, which can be cached and applied with
# two matrix products, and the extra damping is part of what makes the method stable.  See
# :doc:`/theory/damping`.
plt.show()
