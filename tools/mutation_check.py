"""Mutation check: does the test suite catch the bugs K-FAC code actually has?

Each mutant below is one realistic bug (a transposed eigenbasis, a dropped 1/N, a flipped or
non-strict inequality, an ignored option, a tolerance ×10) planted in one file.  For every
mutant the script

1. copies the committed tree (``git archive HEAD``; with ``--working-tree`` the working
   tree, without ``.git``, virtual environments, build and cache folders) once into a
   temporary directory, never touching the checkout, and runs every listed test file on it
   unmutated: a baseline failure stops the check (no kill could be trusted),
2. writes the mutated file there (the exact original snippet must occur once; a snippet
   that no longer occurs is reported ``stale``, not counted),
3. runs the README's test command, ``python -m pytest``, restricted to the mutant's listed
   test files, with ``-x -q -p no:cacheprovider`` and ``KFAC_REF_BACKENDS=numpy,strict``,
   from the copy (the copy's ``kfac_ref`` and ``conformance`` shadow the editable install:
   the script checks that before the first mutant),
4. restores the file, records ``killed`` (pytest failed) or ``survived`` (it passed).

A mutant killed by a subset of the README's command is killed by the whole command (the
whole command runs those same tests, on a superset of backends), so the kill rate printed
here is a lower bound for the README's command.  A mutant that survives the subset might
still be killed by other files: list them with the mutant, do not guess.

Usage::

    .venv/bin/python tools/mutation_check.py            # all mutants, table and kill rate
    .venv/bin/python tools/mutation_check.py -k ekfac   # mutants whose id contains "ekfac"
    nox -s mutants

Exit status 0 when the kill rate is at least ``--target`` (default 0.95), 1 otherwise.

Equivalent mutants (changes that cannot alter any result, so no test can kill them) are not
in :data:`MUTANTS`; :data:`EQUIVALENT` lists the ones considered, with the argument.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IGNORE = shutil.ignore_patterns(".git", ".venv", ".nox", "__pycache__", "*.egg-info",
                                "_build", ".pytest_cache", ".hypothesis", ".ruff_cache",
                                "*.pyc")


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    original: str
    replacement: str
    description: str
    tests: tuple[str, ...]


M = Mutant
EKFAC_TESTS = ("tests/test_oracle_blocks.py", "tests/test_blocks_ekfac.py")
LOSS_TESTS = ("tests/test_losses_oracles.py", "tests/test_losses_products.py")
MUTANTS = [
    # -- blocks --------------------------------------------------------------------------
    M("ekfac-transposed-QG", "kfac_ref/blocks/kfac_jax/_ekfac.py",
      "return xp.matmul(xp.matmul(q_a, y), xp.matrix_transpose(q_g))",
      "return xp.matmul(xp.matmul(q_a, y), q_g)",
      "EKFAC maps back with Q_G instead of Q_Gᵀ", EKFAC_TESTS),
    M("ekfac-transposed-QA", "kfac_ref/blocks/kfac_jax/_ekfac.py",
      "return xp.matmul(xp.matmul(xp.matrix_transpose(q_a), x), q_g)",
      "return xp.matmul(xp.matmul(q_a, x), q_g)",
      "EKFAC projects with Q_A instead of Q_Aᵀ", EKFAC_TESTS),
    M("conv-kron-no-T-scale", "kfac_ref/blocks/kfac_jax/_kronecker.py",
      "        return float(self.num_locations)\n",
      "        return 1.0\n",
      "conv Kronecker block without its |T| pre-factor", ("tests/test_oracle_blocks.py",)),
    M("kron-damping-not-per-scale", "kfac_ref/linalg.py",
      "    lam = damping / scale\n", "    lam = damping\n",
      "factored damping λ instead of λ/s for a scaled (conv) Kronecker block",
      ("tests/test_oracle_blocks.py",)),
    M("pi-inverted", "kfac_ref/linalg.py",
      "    return pi * root, root / pi\n", "    return root / pi, pi * root\n",
      "π-split damping with π and 1/π swapped", ("tests/test_oracle_blocks.py",)),
    M("pi-avg-diag-no-dim", "kfac_ref/linalg.py",
      "        return unit * (xp.sum(diag / unit) / n)\n",
      "        return unit * xp.sum(diag / unit)\n",
      "trace-norm π from traces without dividing by the dimensions",
      ("tests/test_oracle_blocks.py",)),
    M("tf-damping-not-normalised", "kfac_ref/blocks/_math/_common.py",
      "        return damping / k**rho\n", "        return damping\n",
      "TF normalize_damping ignores the number of uses / locations",
      ("tests/test_blocks_tf.py",)),
    M("cov-no-1/N", "kfac_ref/linalg.py",
      "        cov = (tensor.T @ tensor) / normalizer\n",
      "        cov = tensor.T @ tensor\n",
      "covariance without its 1/N", ("tests/test_oracle_blocks.py",)),
    M("homog-coordinate-first", "kfac_ref/linalg.py",
      "return xp.concat([tensor, ones * homog_value], axis=-1)",
      "return xp.concat([ones * homog_value, tensor], axis=-1)",
      "bias (homogeneous) coordinate first instead of last", ("tests/test_oracle_blocks.py",)),
    M("conv-G-over-N-not-NT", "kfac_ref/factors/_conv_kfc.py",
      "return compute_cov.kernel(xp, xp.reshape(g, (-1, g.shape[-1])), None, rows)",
      "return compute_cov.kernel(xp, xp.reshape(g, (-1, g.shape[-1])), None, n)",
      "conv output factor normalised by N instead of N·|T|", ("tests/test_oracle_blocks.py",)),
    M("naive-summed-as-per-source", "kfac_ref/blocks/kfac_jax/_layers.py",
      'if self.source_reduction == "summed":', "if False:",
      "naive blocks ignore source_reduction='summed'", ("tests/test_oracle_blocks.py",)),
    M("singular-rule-not-inclusive", "kfac_ref/linalg.py",
      "if exp < 0 and not bool(xp.min(s) > _singular_tolerance(xp, s, n)):",
      "if exp < 0 and not bool(xp.min(s) >= _singular_tolerance(xp, s, n)):",
      "singular rule σmin ≤ nεσmax made strict (σmin = nεσmax accepted)",
      ("tests/test_thresholds.py",)),
    M("singular-rule-no-n", "kfac_ref/linalg.py",
      "    return order * eps * xp.max(xp.abs(spectrum))\n",
      "    return eps * xp.max(xp.abs(spectrum))\n",
      "singular rule without the order n", ("tests/test_thresholds.py",)),
    # -- averaging / estimator ---------------------------------------------------------------
    M("ema-not-normalised", "kfac_ref/averaging.py",
      "            return self.raw if self.weight == 1 else self.raw / self.weight\n",
      "            return self.raw\n",
      "weighted moving average not divided by its total weight",
      ("tests/test_optim_options.py",)),
    M("estimator-exact-mode-no-sqrtC", "kfac_ref/curvature/_block_diagonal.py",
      "        root = math.sqrt(c)\n", "        root = 1.0\n",
      "exact-mode G misses the 1/C of the averaged output vectors (×C)",
      ("tests/test_optim_options.py",)),
    # -- losses ------------------------------------------------------------------------------
    M("normal-fisher-factor-variance", "kfac_ref/losses.py",
      "        return (vector * (self._sqrt_w(weighted) / self._sqrt_variance),)",
      "        return (vector * (self._sqrt_w(weighted) / self._variance),)",
      "Gaussian Fisher factor 1/v instead of 1/√v", LOSS_TESTS),
    M("softmax-fisher-factor-p", "kfac_ref/losses.py",
      "        bu = q * vector - p * xp.sum(q * vector, axis=-1, keepdims=True)",
      "        bu = q * vector - q * xp.sum(q * vector, axis=-1, keepdims=True)",
      "softmax Fisher factor diag(√p) − √p√pᵀ instead of diag(√p) − p√pᵀ",
      LOSS_TESTS),
    M("softmax-grad-sign", "kfac_ref/losses.py",
      "        return (self._masked(p * (1.0 - y) - y * rest) * c,)",
      "        return (self._masked(y * rest - p * (1.0 - y)) * c,)",
      "cross-entropy gradient with the wrong sign", ("tests/test_optim_options.py",)),
    # -- optimiser ---------------------------------------------------------------------------
    M("lm-upper-not-strict", "kfac_ref/optim.py",
      "decrease, increase = r > upper, r < lower",
      "decrease, increase = r >= upper, r < lower",
      "LM rule: ρ ≥ 3/4 instead of ρ > 3/4", ("tests/test_thresholds.py",)),
    M("lm-lower-not-strict", "kfac_ref/optim.py",
      "decrease, increase = r > upper, r < lower",
      "decrease, increase = r > upper, r <= lower",
      "LM rule: ρ ≤ 1/4 instead of ρ < 1/4", ("tests/test_thresholds.py",)),
    M("lm-tf-no-loss-fell-rule", "kfac_ref/optim.py",
      "decrease = ((new_loss - loss < 0) & (quad_change > 0)) | (rho > upper)",
      "decrease = rho > upper",
      "TF rule: the damping no longer falls when the loss fell against the model",
      ("tests/test_optim.py",)),
    M("lm-clip-max-ignored", "kfac_ref/optim.py",
      "        new = xp.minimum(new, xp.full_like(new, max_damping))\n",
      "        new = new\n", "max_damping ignored", ("tests/test_thresholds.py",)),
    M("precon-damping-mult-ignored", "kfac_ref/optim.py",
      "lam_p = lam * self.precon_damping_mult", "lam_p = lam",
      "precon_damping_mult ignored", ("tests/test_optim_options.py",)),
    M("include-damping-ignored-qmodel", "kfac_ref/optim.py",
      "a_final = m if include else a", "a_final = a",
      "include_damping_in_quad_change ignored by the quadratic model",
      ("tests/test_optim_options.py",)),
    M("include-damping-half-dropped", "kfac_ref/optim.py",
      "quad = quad + 0.5 * lam * _dot(xp, delta, delta)",
      "quad = quad + lam * _dot(xp, delta, delta)",
      "approximate model's damping term λδᵀδ instead of ½λδᵀδ",
      ("tests/test_optim_options.py",)),
    M("exact-quad-model-ignored", "kfac_ref/optim.py",
      'if self.damping_quad_model == "exact":', "if False:",
      "damping_quad_model='exact' ignored", ("tests/test_optim_options.py",)),
    M("fixedmu-ignores-mu", "kfac_ref/optim.py",
      "wi = -(b[i] + m[i, j] * wj) / safe(m[i, i])", "wi = -b[i] / safe(m[i, i])",
      "qmodel_fixedmu: α minimised as if μ were 0", ("tests/test_optim_options.py",)),
    M("tf-ema-weights-swapped", "kfac_ref/optim.py",
      "else (self.curvature_ema, 1.0 - self.curvature_ema))",
      "else (1.0 - self.curvature_ema, self.curvature_ema))",
      "ema_style='tf' with the decay on the new statistics", ("tests/test_optim_options.py",)),
    M("norm-constraint-no-sqrt", "kfac_ref/optim.py",
      "nu = xp.where(sq > c, xp.sqrt(ratio), one)", "nu = xp.where(sq > c, ratio, one)",
      "norm constraint ν = c/(η²pᵀg) instead of its square root",
      ("tests/test_optim_options.py",)),
    M("weight-decay-no-lr", "kfac_ref/optim.py",
      "new_flat = new_flat - (eta * self.weight_decay) * flat",
      "new_flat = new_flat - self.weight_decay * flat",
      "weight decay without the learning rate", ("tests/test_optim_options.py",)),
    M("adaptation-off-by-one", "kfac_ref/optim.py",
      "if self.adapt_damping and (t + 1) % self.damping_adaptation_interval == 0:",
      "if self.adapt_damping and t % self.damping_adaptation_interval == 0:",
      "damping adapted at the first step of each interval", ("tests/test_optim_options.py",)),
    M("adam-momentum-after-preconditioning", "kfac_ref/optim.py",
      "src = g if mt == \"regular\" else mu * velocity + g", "src = g",
      "'adam' momentum applied after preconditioning", ("tests/test_optim_options.py",)),
    M("approx-power-current-damping", "kfac_ref/optim.py",
      "lam = lam_p if self.exact_power else state.preconditioner_damping", "lam = lam_p",
      "approximate preconditioner with the current damping instead of its refresh's",
      ("tests/test_optim_options.py",)),
    M("curvature-period-ignored", "kfac_ref/optim.py",
      "if t % self.curvature_update_period == 0:", "if True:",
      "curvature statistics updated every step", ("tests/test_optim_options.py",)),
    # -- own model ---------------------------------------------------------------------------
    M("own-model-patch-permutation", "conformance/own_model/_reference.py",
      "reshape(kh, kw, c_in).transpose(2, 0, 1).ravel()",
      "reshape(kh, kw, c_in).transpose(2, 1, 0).ravel()",
      "unfold patch order (C, kw, kh) instead of (C, kh, kw)",
      ("tests/conformance/test_own_model_numpy.py",)),
    M("own-model-dense-G-over-NS", "conformance/own_model/_reference.py",
      "np.asarray(fc(g2)) * (g2.shape[0] / n), t",
      "np.asarray(fc(g2)) * (g2.shape[0] / a2.shape[0]), t",
      "dense G normalised by N·S instead of N (KFAC-expand)",
      ("tests/conformance/test_own_model_numpy.py",)),
    M("own-model-reduce-sum", "conformance/own_model/_reference.py",
      ".reshape(n, t, -1).mean(axis=1)", ".reshape(n, t, -1).sum(axis=1)",
      "KFAC-reduce with the summed instead of the mean patch",
      ("tests/conformance/test_own_model_numpy.py",)),
    M("own-model-tolerance-no-K", "conformance/own_model/_check.py",
      'rows = n * t * (r["K"] if fac != "A" else 1)',
      "rows = n * t",
      "own-model tolerance without the K output vectors",
      ("tests/conformance/test_own_model_numpy.py",)),
    M("own-model-tolerance-x10", "conformance/own_model/_check.py",
      "tol = Tolerance(SAFETY * (rows + exp.shape[-1]),",
      "tol = Tolerance(10 * SAFETY * (rows + exp.shape[-1]),",
      "own-model tolerance ×10", ("tests/conformance/test_own_model_numpy.py",)),
    # -- diagnosis ---------------------------------------------------------------------------
    M("diagnosis-rtol-strict", "conformance/diagnosis.py",
      "return r <= self.rtol or (r <= EXPLAIN_RTOL and r <= EXPLAIN_REDUCTION * self.e0)",
      "return r < self.rtol or (r <= EXPLAIN_RTOL and r <= EXPLAIN_REDUCTION * self.e0)",
      "explains: r < rtol instead of r ≤ rtol", ("tests/test_thresholds.py",)),
    M("diagnosis-reduction-strict", "conformance/diagnosis.py",
      "return r <= self.rtol or (r <= EXPLAIN_RTOL and r <= EXPLAIN_REDUCTION * self.e0)",
      "return r <= self.rtol or (r <= EXPLAIN_RTOL and r < EXPLAIN_REDUCTION * self.e0)",
      "explains: r < EXPLAIN_REDUCTION·e0 instead of ≤", ("tests/test_thresholds.py",)),
    M("diagnosis-reduction-x10", "conformance/diagnosis.py",
      "EXPLAIN_REDUCTION = 1e-3\n", "EXPLAIN_REDUCTION = 1e-2\n",
      "EXPLAIN_REDUCTION ×10", ("tests/test_thresholds.py",)),
    M("diagnosis-no-reduction-clause", "conformance/diagnosis.py",
      "return r <= self.rtol or (r <= EXPLAIN_RTOL and r <= EXPLAIN_REDUCTION * self.e0)",
      "return r <= self.rtol or r <= EXPLAIN_RTOL",
      "explains without the reduction clause", ("tests/test_thresholds.py",)),
]

#: considered and left out: changes that cannot alter any result (argued)
EQUIVALENT = {
    "ema_style 'tf' weights (d, 1 − d) → (d, 1)":
        "the estimator divides its average by the total weight, so both give "
        "Σ d^(t−s) C_s / Σ d^(t−s) (tested as equivalent in tests/test_optim_options.py)",
    "quad_model_matrix 'fisher' → 'ggn'":
        "Fisher = GGN for every shipped loss (exponential families in natural parameters)",
    "kron_factored_apply: left @ b_pow → left @ b_powᵀ":
        "b_pow is a symmetric matrix function of a symmetric factor",
}


def run_pytest(tree: Path, tests, timeout: float) -> tuple[str, float, str]:
    env = dict(os.environ, KFAC_REF_BACKENDS="numpy,strict", PYTHONPATH=str(tree),
               PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return "killed (timeout)", time.perf_counter() - t0, ""
    dt = time.perf_counter() - t0
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    if proc.returncode == 0:
        return "survived", dt, tail[0]
    if proc.returncode in (1, 2, 3):  # failures, interruption (-x), internal error
        return "killed", dt, tail[0]
    return f"error (rc {proc.returncode})", dt, tail[0]


def check_shadowing(tree: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(tree))
    code = "import kfac_ref, conformance; print(kfac_ref.__file__); print(conformance.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    for path in out:
        if not Path(path).resolve().is_relative_to(tree.resolve()):
            raise SystemExit(f"mutation_check: the copy does not shadow the install ({path})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", default="", help="run only mutants whose id contains this")
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant")
    ap.add_argument("--working-tree", action="store_true",
                    help="mutate a copy of the working tree instead of the committed HEAD")
    args = ap.parse_args(argv)
    mutants = [m for m in MUTANTS if args.k in m.id]
    ids = [m.id for m in MUTANTS]
    assert len(set(ids)) == len(ids), "duplicate mutant ids"
    results = []
    with tempfile.TemporaryDirectory(prefix="kfac_ref_mutants_") as tmp:
        tree = Path(tmp) / "repo"
        if args.working_tree:
            shutil.copytree(ROOT, tree, ignore=IGNORE, symlinks=True)
        else:
            tree.mkdir()
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "HEAD"],
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        check_shadowing(tree)
        files = sorted({f for m in mutants for f in m.tests})
        status, dt, tail = run_pytest(tree, files, args.timeout)
        shown = "passed" if status == "survived" else f"FAILED ({status})"
        print(f"{'baseline (unmutated)':40s} {shown:10s} {dt:6.1f} s  {tail}", flush=True)
        if status != "survived":
            print("mutation_check: the unmutated tree fails its tests; no kill can be trusted")
            return 2
        for m in mutants:
            path = tree / m.file
            original = path.read_text(encoding="utf-8") if path.exists() else ""
            if original.count(m.original) != 1:
                results.append((m, "stale", 0.0, f"snippet found {original.count(m.original)}×"))
                print(f"{m.id:40s} stale", flush=True)
                continue
            path.write_text(original.replace(m.original, m.replacement), encoding="utf-8")
            try:
                status, dt, tail = run_pytest(tree, m.tests, args.timeout)
            finally:
                path.write_text(original, encoding="utf-8")
            results.append((m, status, dt, tail))
            print(f"{m.id:40s} {status:10s} {dt:6.1f} s  {tail}", flush=True)
    counted = [r for r in results if r[1] != "stale"]
    killed = sum(r[1].startswith("killed") for r in counted)
    print()
    print(f"{'mutant':40s} {'file':42s} {'status':10s} description")
    for m, status, _, _ in results:
        print(f"{m.id:40s} {m.file:42s} {status:10s} {m.description}")
    rate = killed / len(counted) if counted else 0.0
    stale = len(results) - len(counted)
    print(f"\nkilled {killed} of {len(counted)} mutants: kill rate {rate:.1%}"
          + (f" ({stale} stale snippets not counted)" if stale else ""))
    print("equivalent mutants left out:")
    for k, why in EQUIVALENT.items():
        print(f"  {k}: {why}")
    return 0 if rate >= args.target else 1


if __name__ == "__main__":
    raise SystemExit(main())
