"""nox sessions: tests per backend, lint, docs, conformance.

    nox -s tests-numpy tests-strict tests-torch   # the test matrix, one backend family each
    nox -s tests-jax tests-dask                   # JAX (float64, float32; jit/vmap), Dask
    nox -s tests                                  # every available backend in one run
    nox -s lint                                   # ruff
    nox -s docs                                   # Sphinx, warnings as errors, offline
    nox -s conformance                            # the conformance run on the kfac_ref adapter
    nox -s conformance-kfac_jax                   # one peer in its own environment (see below)
    nox -s bench                                  # the benchmark suite (python -m benchmarks)
    nox -s bench-curvlinops bench-kfac_jax        # full updates against a peer, in its env
"""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "tests-numpy", "tests-strict", "tests-torch", "conformance"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.11"
#: what ruff checks (the same list as .ci/run)
LINTED = ("kfac_ref", "tests", "benchmarks", "noxfile.py", "conformance", "docs/_ext", "tools")
# torch is optional and comes from PyTorch's CPU wheel index: from PyPI the same pin is the
# CUDA build (~530 MB plus NVIDIA packages).
TORCH = ("torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cpu")


def _tests(session: nox.Session, backends: str, torch: bool = False,
           extras: str = "test") -> None:
    session.install("-e", f".[{extras}]")
    if torch:
        session.install(*TORCH)
    session.run("python", "-m", "pytest", "-q", *session.posargs,
                env={"KFAC_REF_BACKENDS": backends})


@nox.session(python=PYTHON, name="tests-numpy")
def tests_numpy(session: nox.Session) -> None:
    """The test suite on NumPy arrays."""
    _tests(session, "numpy")


@nox.session(python=PYTHON, name="tests-strict")
def tests_strict(session: nox.Session) -> None:
    """The test suite on array-api-strict: CPU_DEVICE, device1 and no_float64 (float32)."""
    _tests(session, "strict")


@nox.session(python=PYTHON, name="tests-torch")
def tests_torch(session: nox.Session) -> None:
    """The test suite on PyTorch CPU tensors (float64 and float32)."""
    _tests(session, "torch-cpu", torch=True)


@nox.session(python=PYTHON, name="tests-jax")
def tests_jax(session: nox.Session) -> None:
    """The test suite on JAX CPU arrays, float64 (x64 mode) and float32, and the
    jax.jit / jax.vmap tests."""
    _tests(session, "jax", extras="test,jax")


@nox.session(python=PYTHON, name="tests-dask")
def tests_dask(session: nox.Session) -> None:
    """The Dask tests (factor statistics chunk by chunk, a distributed LocalCluster)."""
    session.install("-e", ".[test,dask]")
    session.run("python", "-m", "pytest", "-q", "tests/test_dask.py", *session.posargs)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The whole test matrix (every backend installed in the session)."""
    session.install("-e", ".[test,jax,dask]")
    session.install(*TORCH)
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff over the library, the tests and the tooling."""
    session.install("ruff>=0.5")
    session.run("ruff", "check", *LINTED)


@nox.session(python=PYTHON)
def conformance(session: nox.Session) -> None:
    """The main job: golden vectors up to date, then the suite on every reference adapter
    installed here (kfac_ref on NumPy, array-api-strict, PyTorch, float32), with the ecosystem
    matrix written to ./conformance-reports/."""
    session.install("-e", ".[test]")
    session.install(*TORCH)
    session.run("python", "-m", "conformance", "golden", "--check")
    session.run("python", "-m", "conformance", "--all-adapters", *session.posargs)


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Sphinx HTML and doctest builds, warnings as errors, offline (MathJax ships in the repo);
    fails when a public symbol is undocumented or its docstring has no formula."""
    session.install("-e", ".[docs]")
    session.run("bash", "docs/build.sh", external=True)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """The benchmark suite: kfac_ref against hand-written NumPy, JSON and Markdown in
    ./benchmark-results/ (pass options after ``--``, e.g. ``nox -s bench -- --quick``)."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "benchmarks", *session.posargs)


# --------------------------------------------------------------------------------------
# Peer conformance runs: one session per peer, each in its own environment built from the
# recipe in conformance/peers/<env>.txt (one `pip install` per line; see that folder's README).
# CI builds only the jax environment (.ci/run, step 8); the others are GB-sized. Run them by
# name, e.g.
#     nox -s conformance-kfac_jax
# --------------------------------------------------------------------------------------
PEERS = {  # adapter name -> environment recipe
    "tf_kfac": "tf",
    "kfac_jax": "jax",
    "curvlinops": "torchpeers",
    "backpack": "torchpeers",
    "asdl": "torchpeers",
    "nngeometry": "torchpeers",
}


def _install_recipe(session: nox.Session, env: str) -> None:
    import shlex
    from pathlib import Path

    pin = ["-c", "conformance/peers/torch-pin.txt"] if env == "torchpeers" else []
    for line in Path(f"conformance/peers/{env}.txt").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            session.install(*pin, *shlex.split(line))
    if env == "torchpeers":
        # torchvision's C extension does not load against the pinned CPU torch.
        session.run("python", "-m", "pip", "uninstall", "-y", "torchvision")


def _peer_session(adapter: str, env: str):
    def run(session: nox.Session) -> None:
        _install_recipe(session, env)
        out = "conformance/peers/reports"
        args = ["python", "-m", "conformance", "run", "--adapter", adapter, "--out", out]
        skips = f"conformance/peers/skips/{adapter}.txt"
        from pathlib import Path

        if Path(skips).exists():
            args += ["--skips", skips]
        session.run(*args, *session.posargs, success_codes=[0, 1])
        session.run("python", "-m", f"conformance.peers.repro_{adapter}", "--json",
                    f"{out}/repro_{adapter}.json")

    run.__doc__ = f"Conformance run of the {adapter} adapter in its own '{env}' environment."
    return run


for _adapter, _env in PEERS.items():
    nox.session(python=PYTHON, name=f"conformance-{_adapter}")(_peer_session(_adapter, _env))


def _bench_peer_session(env: str):
    def run(session: nox.Session) -> None:
        _install_recipe(session, env)
        session.run("python", "-m", "benchmarks", "--peers-only", "--out",
                    f"benchmark-results/{env}", *session.posargs)

    run.__doc__ = (f"Full-update benchmark rows against the peer of the '{env}' environment "
                   f"(python -m benchmarks --peers-only; results in benchmark-results/{env}/).")
    return run


for _peer in ("curvlinops", "kfac_jax"):
    nox.session(python=PYTHON, name=f"bench-{_peer}")(_bench_peer_session(PEERS[_peer]))


@nox.session(python=PYTHON, name="conformance-matrix")
def conformance_matrix(session: nox.Session) -> None:
    """Merge the peers' committed reports into the ecosystem matrix."""
    session.install("-e", ".")
    session.run("python", "-m", "conformance", "matrix",
                *__import__("glob").glob("conformance/peers/reports/*/report.json"),
                "--out", "conformance/peers/reports")


@nox.session(python=PYTHON)
def mutants(session: nox.Session) -> None:
    """Mutation check: realistic bugs planted one at a time in a temporary copy of the tree,
    each run against the README's test command restricted to its listed test files
    (tools/mutation_check.py; prints the table and the kill rate, fails below 95 %)."""
    session.install("-e", ".[test]")
    session.run("python", "tools/mutation_check.py", *session.posargs)
