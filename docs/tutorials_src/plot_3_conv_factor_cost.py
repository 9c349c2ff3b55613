r"""
The cost of a convolution factor
================================

For a convolution, K-FAC's input factor is the second moment of the *patches* the kernel
reads (KFC, :doc:`/theory/kfc`).  The factor itself is small —
:math:`(k_h k_w C_\text{in} + 1)^2` entries — but computing it means expanding every image
into one patch per output location.  This tutorial

1. checks :func:`~kfac_ref.factors.conv_input_kronecker_factor` against an explicit
   loop over examples and locations;
2. counts what the factors, the exact block and the patch matrix cost for typical layers;
3. shows how the patch matrix grows with the image size, the padding and the stride;
4. shows what patch subsampling (TF K-FAC's ``_SUB_SAMPLE_PATCHES``) trades for it.
"""

# %%
# The factor against an explicit loop
# -----------------------------------
# With NHWC images, an HWIO kernel of shape ``[kh, kw, C_in, C_out]``, "SAME" padding and
# stride 1, the patch of output location :math:`(i, j)` is the ``kh × kw × C_in`` window
# of the zero-padded image, flattened with the channel fastest, plus a 1 for the bias.
# The factor averages its outer products over examples *and* locations:
#
# .. math::
#
#    A = \frac{1}{N|T|} \sum_{n} \sum_{t \in T} \bar p_{n,t} \bar p_{n,t}^\top .
import matplotlib.pyplot as plt
import numpy as np

from kfac_ref.factors import conv_input_kronecker_factor
from kfac_ref.patches import extract_convolution_patches, num_conv_locations

rng = np.random.default_rng(0)
N, H, W, C_in, C_out, k = 2, 5, 4, 3, 4, 3
x = rng.standard_normal((N, H, W, C_in))
A = conv_input_kronecker_factor(x, [k, k, C_in, C_out], "SAME", has_bias=True)

pad = (k - 1) // 2  # "SAME", stride 1, odd kernel: the same on both sides
xp = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
oracle = np.zeros_like(A)
for n in range(N):
    for i in range(H):
        for j in range(W):
            p = np.append(xp[n, i : i + k, j : j + k, :].reshape(-1), 1.0)
            oracle += np.outer(p, p)
oracle /= N * H * W
print("factor shape:", A.shape)
print("max |A - loop|:", np.max(np.abs(A - oracle)))
print("bias corner:", A[-1, -1])

# %%
# What it costs
# -------------
# For a layer with a ``kh × kw`` kernel, :math:`C_\text{in}` input and
# :math:`C_\text{out}` output channels, :math:`|T|` output locations and a batch of
# :math:`N`:
#
# * the two factors have :math:`(k_h k_w C_\text{in}+1)^2` and :math:`C_\text{out}^2`
#   entries, the exact block :math:`((k_h k_w C_\text{in}+1) C_\text{out})^2`;
# * the patch matrix has :math:`N |T| k_h k_w C_\text{in}` entries, :math:`k_h k_w` times
#   the input (for stride 1), and forming :math:`A` from it is one GEMM of
#   :math:`N|T| (k_h k_w C_\text{in}+1)^2` multiply-adds.
#
# In float64 (8 bytes per entry):
layers = [  # name, N, |T| (H*W), kh, kw, C_in, C_out
    ("3x3, 64 ch, 32x32, N=128", 128, 32 * 32, 3, 3, 64, 64),
    ("3x3, 256 ch, 8x8, N=128", 128, 8 * 8, 3, 3, 256, 256),
    ("7x7, 3->64 ch, 112x112, N=32", 32, 112 * 112, 7, 7, 3, 64),
]
print(
    f"{'layer':29s} {'A, G [MB]':>10s} {'exact block [GB]':>17s} {'patches [GB]':>13s} "
    f"{'GEMM [GFLOP]':>13s}"
)
for name, n, t, kh, kw, cin, cout in layers:
    d_a = kh * kw * cin + 1
    factors_mb = 8 * (d_a**2 + cout**2) / 1e6
    block_gb = 8 * (d_a * cout) ** 2 / 1e9
    patches_gb = 8 * n * t * kh * kw * cin / 1e9
    gflop = 2 * n * t * d_a**2 / 1e9
    print(f"{name:29s} {factors_mb:10.2f} {block_gb:17.1f} {patches_gb:13.2f} {gflop:13.1f}")

# %%
# The factors are megabytes where the exact block would be gigabytes to terabytes — the
# reason K-FAC exists.  The price moves to the statistics: the patch matrix of an early,
# high-resolution layer is larger than the activations it comes from, and the GEMM that
# reduces it dominates the cost of the factor.
#
# How padding and stride change the cost
# --------------------------------------
# The cost of the statistics is set by the patch matrix: :math:`N|T|` rows of length
# :math:`k_h k_w C_\text{in}`.  :math:`|T|` depends on the padding and, quadratically, on the
# stride — a common source of wrong conv-factor scalings when an implementation counts
# input instead of output locations.  We read the patch-matrix size off the array that
# :func:`~kfac_ref.patches.extract_convolution_patches` returns and check :math:`|T|` against
# :func:`~kfac_ref.patches.num_conv_locations`.  (Wall-clock time follows the same counts;
# it is not plotted because timings on a shared build machine are noisy.)
sizes = [8, 12, 16, 24, 32, 48, 64]
settings = [("SAME", 1), ("VALID", 1), ("SAME", 2)]
entries = {setting: [] for setting in settings}
for s in sizes:
    xs = np.zeros((8, s, s, 8))
    for padding, stride in settings:
        patches = extract_convolution_patches(xs, [3, 3, 8, 16], padding, strides=stride)
        t = num_conv_locations(xs.shape, [3, 3, 8, 16], stride, padding)
        assert patches.shape[0] * t * 3 * 3 * 8 == patches.size  # N |T| kh kw C_in
        entries[(padding, stride)].append(patches.size)
print("entries at H = 64: the input", 8 * 64 * 64 * 8)
for (padding, stride), e in entries.items():
    print(f"  patch matrix, {padding}, stride {stride}: {e[-1]}")

fig, ax = plt.subplots(figsize=(7, 4))
for (padding, stride), e in entries.items():
    ax.loglog(sizes, e, "o-", label=f"{padding}, stride {stride}")
ax.loglog(sizes, [8 * s * s * 8 for s in sizes], "k:", label="the input itself")
ax.set_xlabel("image height = width H")
ax.set_ylabel("patch-matrix entries")
ax.set_title("3x3 conv, N = 8, 8 -> 16 channels")
ax.legend()
fig.tight_layout()

# %%
# With stride 1 the patch matrix is :math:`k_h k_w = 9` times the input; stride 2 divides
# :math:`|T|`, and therefore the memory and the GEMM, by four.  "VALID" padding loses the
# border locations, which matters only for small images.
#
# Subsampling patches
# -------------------
# TF K-FAC can estimate :math:`A` from a random subset of patch rows: it keeps
# :math:`\min(M_\text{max}, \lceil \rho D \rceil)` rows, :math:`D` the patch dimension.
# kfac_ref offers the same through ``sub_sample_patches=True``, with the draws made from an
# explicit ``numpy.random.Generator`` so the estimate is reproducible.  The relative error
# of the estimate shrinks roughly like one over the square root of the rows kept.
xs = rng.standard_normal((16, 16, 16, 4))
full = conv_input_kronecker_factor(xs, [3, 3, 4, 8], "SAME", has_bias=True)
d_patch = 3 * 3 * 4
rhos = [1, 2, 4, 8, 16, 32, 64]
kept, errs = [], []
for rho in rhos:
    e = []
    for seed in range(5):
        est = conv_input_kronecker_factor(
            xs,
            [3, 3, 4, 8],
            "SAME",
            has_bias=True,
            sub_sample_patches=True,
            rng=np.random.default_rng(seed),
            max_num_patches_per_dimension=float(rho),
        )
        e.append(np.linalg.norm(est - full) / np.linalg.norm(full))
    kept.append(min(int(np.ceil(rho * d_patch)), 16 * 16 * 16))
    errs.append(np.mean(e))

fig, ax = plt.subplots(figsize=(7, 4))
ax.loglog(kept, errs, "o-", label="mean over 5 seeds")
ideal = errs[0] * np.sqrt(kept[0] / np.array(kept))
ax.loglog(kept, ideal, "k:", label=r"$\propto 1/\sqrt{m}$")
ax.axvline(16 * 16 * 16, color="grey", ls="--", label="all patches")
ax.set_xlabel("patch rows kept m")
ax.set_ylabel(r"$\|\hat A - A\|_F / \|A\|_F$")
ax.set_title("Subsampled input factor, 16 images of 16x16x4")
ax.legend()
fig.tight_layout()
plt.show()
