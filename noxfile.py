"""nox sessions: tests per backend, lint, docs, conformance.

    nox -s tests-numpy tests-strict tests-torch   # the test matrix, one backend family each
    nox -s tests                                  # every available backend in one run
    nox -s lint                                   # ruff
    nox -s docs                                   # Sphinx, warnings as errors, offline
    nox -s conformance                            # the conformance run on the kfac_ref adapter
"""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "tests-numpy", "tests-strict", "tests-torch", "conformance"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.11"
# torch is pinned: an unpinned torch pulls a multi-GB CUDA build; 2.13.0 is the CPU wheel.
TORCH = "torch==2.13.0"


def _tests(session: nox.Session, backends: str, extras: str = "test") -> None:
    session.install("-e", f".[{extras}]")
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
    """The test suite on PyTorch CPU tensors (float64)."""
    _tests(session, "torch-cpu", extras="test,torch")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The whole test matrix (every backend installed in the session)."""
    session.install("-e", ".[test,torch]")
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff over the library, the tests and the tooling."""
    session.install("ruff>=0.5")
    session.run("ruff", "check", "kfac_ref", "tests", "benchmarks", "noxfile.py")


@nox.session(python=PYTHON)
def conformance(session: nox.Session) -> None:
    """The main job: golden vectors up to date, then the suite on every reference adapter
    installed here (kfac_ref on NumPy, array-api-strict, PyTorch, float32), with the ecosystem
    matrix written to conformance/_out/."""
    session.install("-e", ".[test,torch]")
    session.run("python", "-m", "conformance", "golden", "--check")
    session.run("python", "-m", "conformance", "--all-adapters", *session.posargs)


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Sphinx HTML and doctest builds, warnings as errors, offline (MathJax ships in the repo);
    fails when a public symbol is undocumented or its docstring has no formula."""
    session.install("-e", ".[docs]")
    session.run("bash", "docs/build.sh", external=True)
