r"""
Factors of a data set larger than memory, with Dask
===================================================

The K-FAC factors of a layer are batch averages,

.. math::

   A = \frac{1}{N} \sum_{n=1}^{N} \bar a_n \bar a_n^\top, \qquad
   G = \frac{1}{N} \sum_{n=1}^{N} B_n B_n^\top ,

with :math:`\bar a_n = [a_n; 1]` the layer's input with the bias column and :math:`B_n`
the factor of the loss's Fisher, :math:`F_n = B_n B_n^\top` (for a last dense layer the
back-propagated vectors are :math:`B_n` itself).  Sums over :math:`n` split over chunks of
the batch, so a data set that does not fit in one machine's memory needs no code of its
own: give kfac_ref `Dask <https://docs.dask.org>`_ arrays chunked along the batch axis and
the same functions build a lazy graph of per-chunk products and one reduction, which
Dask's scheduler runs — here on a ``dask.distributed`` cluster whose workers have far less
memory than the data.

kfac_ref reads a Dask array's namespace through ``array_api_compat`` and skips its value
checks (reading a value would force the computation, see :func:`kfac_ref.value_checks`);
shapes, dtypes and options are still checked at the call.
"""

# %%
# A cluster with less memory than the data
# ----------------------------------------
# A scheduler and two worker processes with one thread and 300 MiB each (about half of
# it is taken by the Python process itself), started with Dask's own command-line tools
# as on any cluster; this script is only a client.  The inputs of a dense layer with 128
# features for 800,000 examples are 0.82 GB in float64 — more than the whole cluster's
# memory.  They are never stored: each chunk of 10,000 examples is generated where it is
# used, from a seed (as a data loader would read it from disk).
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import dask
import dask.array as da
import matplotlib.pyplot as plt
import numpy as np
from distributed import Client
from distributed.diagnostics import MemorySampler

from kfac_ref import factors, losses

WORKERS, LIMIT = 2, 300 * 2**20
N, D_IN, D_OUT, CHUNK = 800_000, 128, 10, 10_000

scheduler_file = Path(tempfile.mkdtemp()) / "scheduler.json"
quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
scheduler = subprocess.Popen(
    [sys.executable, "-m", "distributed.cli.dask_scheduler", "--scheduler-file",
     str(scheduler_file), "--port", "0", "--dashboard-address", ":0"], **quiet)
workers = subprocess.Popen(
    [sys.executable, "-m", "distributed.cli.dask_worker", "--scheduler-file",
     str(scheduler_file), "--nworkers", str(WORKERS), "--nthreads", "1",
     "--memory-limit", str(LIMIT), "--no-dashboard"], **quiet)
while not scheduler_file.exists():
    time.sleep(0.1)
client = Client(scheduler_file=str(scheduler_file))
client.wait_for_workers(WORKERS, timeout=120)

rng = np.random.default_rng(0)
mixing = rng.standard_normal((D_IN, D_IN)) / np.sqrt(D_IN)  # correlated features
weights = rng.standard_normal((D_IN, D_OUT)) / np.sqrt(D_IN)

z = da.random.default_rng(1).standard_normal((N, D_IN), chunks=(CHUNK, D_IN))
inputs = z @ mixing + 0.5  # a non-zero mean, so the bias row of A matters
logits = inputs @ weights
data_bytes = N * D_IN * 8
print(f"inputs: {data_bytes / 2**30:.2f} GiB in {inputs.numblocks[0]} chunks; "
      f"cluster memory: {WORKERS * LIMIT / 2**30:.2f} GiB")

# %%
# The factors, lazily
# -------------------
# The same calls as on NumPy arrays.  The output factor of the last layer comes from the
# categorical loss's Fisher factor, one column :math:`B_n e_k` at a time, with
# :math:`G = \frac1N \sum_k \sum_n (B_n e_k)(B_n e_k)^\top`.


def output_factor(loss):
    cols = [loss.multiply_fisher_factor_replicated_one_hot([k])[0]
            for k in range(loss.fisher_factor_inner_shape[-1])]
    return sum(factors.fully_connected_kronecker_factor(c) for c in cols)


A_lazy = factors.fully_connected_kronecker_factor(inputs, has_bias=True)
G_lazy = output_factor(losses.CategoricalLogitsNegativeLogProbLoss(logits))
print(type(A_lazy).__name__, A_lazy.shape, "and", type(G_lazy).__name__, G_lazy.shape,
      "— nothing computed yet")

sampler = MemorySampler()
t0 = time.perf_counter()
with sampler.sample("factors", interval=0.05):
    A, G = dask.compute(A_lazy, G_lazy)
seconds = time.perf_counter() - t0
samples = np.array(sampler.samples["factors"], dtype=float)  # (time, cluster bytes)
peak = samples[:, 1].max()
print(f"computed in {seconds:.1f} s; peak memory of the whole cluster "
      f"{peak / 2**20:.0f} MiB (limit {WORKERS * LIMIT / 2**20:.0f} MiB, "
      f"data {data_bytes / 2**20:.0f} MiB)")

# %%
# Agreement with the in-memory result
# -----------------------------------
# On a subset that fits in memory — the first two chunks — the same factors computed on
# NumPy arrays and by the cluster agree to float64 rounding (the sums only run in another
# order).  The factors of the whole data set differ from the subset's by sampling error,
# of order :math:`1/\sqrt{n}`, which is the reason to use all of it.
n_sub = 2 * CHUNK
x_sub = inputs[:n_sub].compute()
A_sub = factors.fully_connected_kronecker_factor(x_sub, has_bias=True)
G_sub = output_factor(losses.CategoricalLogitsNegativeLogProbLoss(x_sub @ weights))
A_sub_dask, G_sub_dask = dask.compute(
    factors.fully_connected_kronecker_factor(inputs[:n_sub], has_bias=True),
    output_factor(losses.CategoricalLogitsNegativeLogProbLoss(logits[:n_sub])))


def rel(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


print(f"subset, cluster vs NumPy:     A {rel(A_sub_dask, A_sub):.1e}   "
      f"G {rel(G_sub_dask, G_sub):.1e}")
print(f"whole data vs subset (noise): A {rel(A, A_sub):.1e}   G {rel(G, G_sub):.1e}")
client.shutdown()  # stops the scheduler and the workers
for proc in (workers, scheduler):
    proc.wait(timeout=60)

# %%
# What it looked like
# -------------------
# Left: the cluster's memory while the factors were computed, against the workers'
# limit and the size of the data.  Right: the spectrum of :math:`A` from the whole data
# set and from the in-memory subset.
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(9.5, 3.6))
ax0.plot(samples[:, 0] - samples[0, 0], samples[:, 1] / 2**20, label="cluster memory")
ax0.axhline(WORKERS * LIMIT / 2**20, color="C3", ls="--", label="memory limit")
ax0.axhline(data_bytes / 2**20, color="k", ls=":", label="size of the data")
ax0.set_xlabel("seconds")
ax0.set_ylabel("MiB")
ax0.set_title("memory while computing A and G")
ax0.legend(loc="center right", fontsize=8)
ax1.semilogy(np.linalg.eigvalsh(A)[::-1], label=f"whole data (N = {N:,})")
ax1.semilogy(np.linalg.eigvalsh(A_sub)[::-1], ls="--", label=f"subset (n = {n_sub:,})")
ax1.set_xlabel("index")
ax1.set_title("eigenvalues of A")
ax1.legend(fontsize=8)
fig.tight_layout()
plt.show()
