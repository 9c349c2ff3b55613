r"""Declared capabilities: which backends, transformations and lazy arrays each public
function and class supports — one table, read by the docstrings, the docs and the tests.

Every public object of kfac_ref has a :class:`Support` entry with one state per column:

.. math::

   \begin{aligned}
   \text{state}(f, c) &\in \{\text{yes}, \text{no}, \text{untested}, \text{n/a}\},\\
   c &\in \{\text{numpy}, \text{array\_api\_strict}, \text{torch}, \text{jax}, \text{cupy},
   \text{jit}, \text{vmap}, \text{dask}\}
   \end{aligned}

* **yes** — supported, and the test matrix exercises it (a test fails when a "yes" of an
  eager backend was not exercised by a full run of the suite on that backend's cells, and
  the ``jax.jit``/``jax.vmap``/Dask tests are generated from the "yes" entries);
* **no** — not supported, with the reason; calling it that way raises a clear
  :class:`~kfac_ref.KFACInputError` (tested);
* **untested** — may work, but nothing checks it;
* **n/a** — the object takes no arrays (shapes, options, registries, Python numbers), so
  the array library does not matter.

The eager columns are the array libraries (array-api-strict stands for "any library that
follows the standard", including its restricted devices and its float32-only device).  The
``cupy`` column is exercised only on a machine with a CUDA GPU.  ``jit`` is ``jax.jit`` of
the call with every array argument traced; ``vmap`` is ``jax.vmap`` over a leading batch
of independent problems; ``dask`` is a Dask array chunked along the batch axis, computed
chunk by chunk (value checks are skipped for lazy arrays, see :func:`kfac_ref.value_checks`).

The table is :func:`support_table`; each public object's docstring ends with its row, and
the docs page *Backend support* shows all rows.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field, replace

from ._backend import KFACValueError, describe

__all__ = ["COLUMNS", "EAGER_BACKENDS", "Support", "support_of", "support_table"]

EAGER_BACKENDS = ("numpy", "array_api_strict", "torch", "jax", "cupy")
"""The array libraries of the eager columns."""

COLUMNS = EAGER_BACKENDS + ("jit", "vmap", "dask")
"""Every column of the support table, in order."""

_STATES = ("yes", "no", "untested", "n/a")


@dataclass(frozen=True)
class Support:
    r"""The declared support of one public object: a state per column of
    :data:`COLUMNS`, with the reason of every "no".

    .. math::

       \text{Support} : \text{COLUMNS} \to \{\text{yes}, \text{no}, \text{untested}\}

    Attributes
    ----------
    states : dict
        Column name → ``"yes"``, ``"no"`` or ``"untested"``.
    reasons : dict
        Column name → why it is ``"no"`` (shown in the docs and raised in the error).
    """

    states: dict = field(default_factory=dict)
    reasons: dict = field(default_factory=dict)

    def __post_init__(self):
        for col, state in self.states.items():
            if col not in COLUMNS:
                raise ValueError(f"Support: unknown column {col!r}; the columns are {COLUMNS}.")
            if state not in _STATES:
                raise ValueError(f"Support: state of {col!r} must be one of {_STATES}; "
                                 f"got {state!r}.")
        for col in self.reasons:
            if self.states.get(col) != "no":
                raise ValueError(f"Support: a reason is given for {col!r}, which is not 'no'.")

    def state(self, column: str) -> str:
        """The state of ``column`` (``"untested"`` when not declared).

        Raises
        ------
        KFACValueError
            When ``column`` is not one of :data:`COLUMNS` (a misspelt backend would
            otherwise read as "untested").
        """
        if column not in COLUMNS:
            raise _unknown_name("Support.state", "column", column, COLUMNS,
                                "a column of the support table (a backend or a transformation)")
        return self.states.get(column, "untested")

    def with_states(self, reasons=None, **states) -> Support:
        """A copy with the given columns set (and reasons for the ``"no"`` ones)."""
        return replace(self, states={**self.states, **states},
                       reasons={**self.reasons, **(reasons or {})})


# Every public object supports the eager backends; the suite runs each test on every cell
# of the matrix (numpy, array-api-strict on three devices, torch float64/float32,
# jax float64/float32, cupy where a GPU is present).
_EAGER = Support({b: "yes" for b in EAGER_BACKENDS})

# Overrides, by dotted name of the object where it is documented: a state, or ("no",
# reason).  The jit, vmap and dask columns say "yes" only where tests/test_jit.py,
# tests/test_transforms.py and tests/test_dask.py run the object.
# Objects that take no arrays: every eager column is "n/a".
_ARRAY_FREE = (
    "kfac_ref.value_checks",
    "kfac_ref.register_jax_pytrees",
    "kfac_ref.patches.set_max_temporary_bytes",
    "kfac_ref.capabilities.Support",
    "kfac_ref.capabilities.support_of",
    "kfac_ref.capabilities.support_table",
    "kfac_ref.blocks.kfac_jax.default_layer_to_block",
    "kfac_ref.blocks.kfac_jax.layer_block",
    "kfac_ref.blocks.kfac_jax.register_layer_block",
    "kfac_ref.blocks.kfac_jax.registered_layer_blocks",
    "kfac_ref.blocks.normalize_damping",
    "kfac_ref.blocks.tf.SeriesFBApproximation",
    "kfac_ref.conv_geometry.is_channels_last",
    "kfac_ref.curvature.default_approximations",
    "kfac_ref.nn.kfac_jax_permutation",
    "kfac_ref.nn.torch_permutation",
    "kfac_ref.optim.reduction_ratio",
    "kfac_ref.patches.conv_output_spatial_shape",
    "kfac_ref.patches.conv_padding_amounts",
    "kfac_ref.patches.example_chunks",
    "kfac_ref.patches.num_conv_locations",
    "kfac_ref.patches.num_subsampled_inputs",
    "kfac_ref.patches.num_subsampled_patches",
)

_DECLARED: dict[str, dict] = {
    **{name: {b: "n/a" for b in EAGER_BACKENDS} for name in _ARRAY_FREE},
    "kfac_ref.linalg.compute_cov": {"jit": "yes", "vmap": "yes", "dask": "yes"},
    "kfac_ref.linalg.append_homog": {"jit": "yes", "vmap": "yes"},
    "kfac_ref.linalg.kron_matvec": {"jit": "yes", "vmap": "yes"},
    "kfac_ref.linalg.kron_matmat": {"jit": "yes"},
    "kfac_ref.linalg.damped_matpower": {"jit": "yes"},
    "kfac_ref.linalg.damped_inverse": {"jit": "yes"},
    "kfac_ref.linalg.pi_tracenorm": {"jit": "yes"},
    "kfac_ref.linalg.pi_adjusted_damping": {"jit": "yes"},
    "kfac_ref.linalg.factor_norm": {"jit": "yes"},
    "kfac_ref.linalg.kron_damped_inverse_matvec": {"jit": "yes"},
    "kfac_ref.averaging.weighted_accumulate": {"jit": "yes"},
    "kfac_ref.optim.quadratic_model": {"jit": "yes"},
    "kfac_ref.optim.norm_constraint_coefficient": {"jit": "yes"},
    "kfac_ref.factors.fully_connected_kronecker_factor": {"jit": "yes", "dask": "yes"},
    "kfac_ref.factors.conv_input_kronecker_factor": {"dask": "yes"},
    "kfac_ref.factors.conv_output_kronecker_factor": {"dask": "yes"},
    "kfac_ref.losses.CategoricalLogitsNegativeLogProbLoss": {"jit": "yes", "dask": "yes"},
    "kfac_ref.losses.OneHotCategoricalLogitsNegativeLogProbLoss": {"jit": "yes"},
    "kfac_ref.losses.MultiBernoulliNegativeLogProbLoss": {"jit": "yes", "dask": "yes"},
    "kfac_ref.losses.NormalMeanNegativeLogProbLoss": {"jit": "yes", "dask": "yes"},
    "kfac_ref.losses.NormalMeanVarianceNegativeLogProbLoss": {"jit": "yes"},
    "kfac_ref.losses.AutodiffLoss": {b: ("no", "differentiated by the outputs' own library: "
                                         "pass torch tensors or JAX arrays")
                                     for b in ("numpy", "array_api_strict", "cupy")},
    "kfac_ref.curvature.ggn_vector_product": {"jit": "yes"},
    "kfac_ref.curvature.fisher_vector_product": {"jit": "yes"},
    "kfac_ref.curvature.ggn_matrix": {"jit": "yes"},
    "kfac_ref.curvature.fisher_factor_transpose_product": {"jit": "yes"},
    "kfac_ref.curvature.hessian_vector_product": {"jit": "yes"},
    "kfac_ref.curvature.relative_frobenius_error": {"jit": "yes"},
    **{f"kfac_ref.blocks.kfac_jax.{name}": {"jit": "yes"} for name in (
        "DenseTwoKroneckerFactored", "DenseDiagonal", "DenseFull", "DenseEKFAC",
        "Conv2DTwoKroneckerFactored", "Conv2DDiagonal", "Conv2DFull")},
    **{f"kfac_ref.blocks.kfac_jax.{name}": {"jit": "yes"} for name in (
        "DenseTNT", "Conv2DTNT", "DenseFOOF", "DenseKPSVD")},
    # states cross the jit boundary (JAX pytrees): tests/test_jit_states.py
    "kfac_ref.blocks.kfac_jax.BlockState": {"jit": "yes"},
    "kfac_ref.curvature.BlockDiagonalCurvature": {"jit": "yes"},
    "kfac_ref.curvature.ExplicitExactCurvature": {"jit": "yes"},
    "kfac_ref.curvature.approximation_report": {
        "jit": ("no", "it reads values to build its report; call it on concrete arrays")},
}

# The "dask" column (tests/test_dask.py walks it: each "yes" against NumPy, each "no" raising
# at the call), merged into the declarations above.  Dask's array API namespace has no
# linalg.eigh: what needs an eigendecomposition raises KFACTypeError naming it.
_NO_EIGH = ("no", "eigendecompositions: the namespace of a Dask array has no linalg.eigh")
_DASK: dict[str, object] = {
    **{f"kfac_ref.{name}": "yes" for name in (
        "linalg.append_homog", "linalg.kron_matvec", "linalg.kron_matmat",
        "linalg.damped_inverse", "linalg.pi_tracenorm", "linalg.pi_adjusted_damping",
        "linalg.factor_norm", "averaging.weighted_accumulate",
        "losses.OneHotCategoricalLogitsNegativeLogProbLoss",
        "losses.NormalMeanVarianceNegativeLogProbLoss",
        "linalg.damped_cholesky", "linalg.damped_cholesky_inverse", "linalg.kron",
        "linalg.kron_eigenbasis_matpower", "spectral.kron_trace", "spectral.hutchinson_trace",
        "spectral.hutchpp_trace", "factors.fully_connected_diagonal_factor",
        "factors.conv_patch_matrix", "factors.conv_per_example_gradients",
        "factors.conv_diagonal_factor", "factors.conv_input_sua_statistics",
        "factors.conv_input_sua_factor", "factors.conv_input_sua_inverse",
        "factors.params_grads_to_vector", "factors.naive_diagonal_factor",
        "factors.full_factor", "factors.embedding_input_kronecker_factor",
        "factors.diagonal_kronecker_factor", "factors.scale_and_shift_factor",
        "factors.fully_connected_multi_kf_cov_dt1", "factors.conv_input_factor_tap",
        # the factor classes: statistics, Cholesky inverses, diagonal powers (a dense
        # factor's eigendecomposition raises: no linalg.eigh)
        "factors.FisherFactor", "factors.DenseSquareMatrixFactor",
        "factors.DiagonalFactor", "factors.FullyConnectedKroneckerFactor",
        "factors.FullyConnectedDiagonalFactor", "factors.ConvInputKroneckerFactor",
        "factors.ConvOutputKroneckerFactor", "factors.ConvDiagonalFactor",
        "factors.ConvInputMultiKF", "factors.ConvOutputMultiKF",
        "factors.ConvInputSUAKroneckerFactor", "factors.NaiveDiagonalFactor",
        "factors.FullFactor", "factors.EmbeddingInputKroneckerFactor",
        "factors.DiagonalKroneckerFactor", "factors.DiagonalMultiKF",
        "factors.ScaleAndShiftFullFactor",
        "factors.ScaleAndShiftDiagonalFactor", "factors.FullyConnectedMultiKF",
        "averaging.MovingAverageVariable", "averaging.WeightedMovingAverage",
        "averaging.sync_statistics", "patches.extract_convolution_patches",
        "patches.extract_image_patches", "patches.extract_pointwise_conv2d_patches",
        "patches.subsample_rows", "patches.temporary_bytes_bound", "conv_geometry.ConvGeometry",
        "conv_geometry.to_channels_last", "conv_geometry.from_channels_last",
        "blocks.diagonal_block_matpower",
        "blocks.scaled_identity_matpower", "blocks.series_gamma",
        "blocks.series_option1_multiply_inverse", "blocks.series_option2_multiply_inverse",
        # the factored p = 1 and Cholesky inverse; the eigen paths raise (no linalg.eigh)
        "blocks.kronecker_block_matpower", "losses.CustomLoss",
        "losses.CustomNegativeLogProbLoss", "losses.LossFunction", "losses.NegativeLogProbLoss",
        "losses.NaturalParamsNegativeLogProbLoss",
        # kfac-jax blocks: products and factored inverses; exact inverses and eigenvalues
        # raise (no linalg.eigh)
        *(f"blocks.kfac_jax.{b}" for b in (
            "ScaledIdentity", "NaiveDiagonal", "DenseDiagonal", "Conv2DDiagonal",
            "ScaleAndShiftDiagonal", "DenseTwoKroneckerFactored", "Conv2DTwoKroneckerFactored",
            "NaiveTNT", "DenseTNT", "Conv2DTNT", "DenseFOOF", "DenseKPSVD",
            "nearest_kronecker_factors", "tnt_scale")),
        # TF blocks: products, inverses, Cholesky products; another power raises
        *(f"blocks.tf.{b}" for b in (
            "FullyConnectedKFACBasicFB", "FullyConnectedMultiIndepFB", "ConvKFCBasicFB",
            "ConvKFCBasicMultiIndepFB", "EmbeddingKFACFB", "FullyConnectedDiagonalFB",
            "NaiveDiagonalFB", "compute_pi_tracenorm", "compute_pi_adjusted_damping")),
        # ... and their bases, KFAC-reduce, the diagonal, embedding and depthwise TF blocks
        *(f"blocks.kfac_jax.{b}" for b in (
            "CurvatureBlock", "BlockState", "Diagonal", "TwoKroneckerFactored",
            "ReducedConv2DTwoKroneckerFactored")),
        *(f"blocks.tf.{b}" for b in (
            "FisherBlock", "KroneckerProductFB", "DiagonalFB", "ScaleAndShiftDiagonalFB",
            "ConvDiagonalFB", "EmbeddingKFACMultiIndepFB", "DepthwiseConvDiagonalFB",
            "DepthwiseConvKFCBasicFB")),
        # exact curvature products and matrices; the estimators' products at power 1 and
        # the K-FAC estimator's factored inverse (exact inverses and eigenvalues raise: no
        # linalg.eigh)
        *(f"curvature.{name}" for name in (
            "ggn_matrix", "fisher_matrix", "hessian_matrix", "empirical_fisher_matrix",
            "monte_carlo_fisher_matrix", "estimated_matrix", "estimation_output_vectors",
            "ggn_vector_product", "fisher_vector_product", "hessian_vector_product",
            "empirical_fisher_vector_product", "ggn_factor_product", "fisher_factor_product",
            "ggn_factor_transpose_product", "fisher_factor_transpose_product", "jacobian",
            "jacobian_vector_product", "jacobian_transpose_vector_product",
            "loss_value_and_grad", "block_diag", "relative_frobenius_error",
            "BlockDiagonalCurvature", "BlockDiagonalState", "ExplicitExactCurvature",
            "ImplicitExactCurvature")),
        # layers and networks: forward, tangent, cotangent and second-order passes
        *(f"nn.{name}" for name in (
            "Layer", "Dense", "Conv2D", "Embedding", "ScaleAndShift", "Activation", "Flatten",
            "MeanPool", "Sequential", "ForwardPass", "activation_derivatives", "permute_vector",
            "permute_matrix", "to_torch_parameters", "to_kfac_jax_params")),
        # the optimiser with exact_power=False (the factored inverse; exact_power=True raises)
        *(f"optim.{name}" for name in (
            "KFACOptimizer", "OptimizerState", "StepStats", "adapt_damping",
            "norm_constraint_coefficient", "preconditioned_direction", "quadratic_model")),
        # the "ekfac" and "diagonal" structures; "kron", "kron_factored" and "full" raise (no
        # linalg.eigh / linalg.eigvalsh)
        "laplace.laplace_log_marginal_likelihood", "laplace.laplace_log_marginal_likelihood_grad",
        # products, dense matrix, trace; eigenvalues and log-determinants of blocks other than
        # Kronecker ones raise (no linalg.eigvalsh)
        "operators.CurvatureOperator")},
    **{f"kfac_ref.{name}": _NO_EIGH for name in (
        "linalg.damped_matpower", "linalg.kron_damped_inverse_matvec",
        "linalg.clipped_eigh", "linalg.kron_damped_matpower_matvec", "spectral.kron_eigenvalues",
        "spectral.kron_slogdet", "factors.series_option1_quantities",
        "factors.series_option2_quantities", "blocks.full_block_matpower",
        "blocks.kronecker_block_eigenvalues", "blocks.kronecker_difference_inverse",
        "blocks.block_tridiagonal_multiply_inverse",
        # a full block's every inverse and its eigenvalues take an eigendecomposition
        *(f"blocks.kfac_jax.{b}" for b in (
            "NaiveFull", "DenseFull", "Conv2DFull", "ScaleAndShiftFull", "Full")),
        "blocks.tf.FullFB", "blocks.tf.NaiveFullFB", "blocks.tf.ScaleAndShiftFullFB",
        # EKFAC's eigenbasis and the series inverses are eigendecompositions of the factors
        *(f"blocks.kfac_jax.{b}" for b in (
            "EigenbasisKroneckerFactored", "DenseEKFAC", "Conv2DEKFAC")),
        "blocks.tf.FullyConnectedSeriesFB")},
    "kfac_ref.curvature.approximation_report": (
        "no", "it reads values to build its report; call it on concrete arrays"),
    "kfac_ref.losses.AutodiffLoss": ("no", "differentiated by the outputs' own library: "
                                     "pass torch tensors or JAX arrays"),
}
for _name, _state in _DASK.items():
    _DECLARED[_name] = {**_DECLARED.get(_name, {}), "dask": _state}


def _public_modules():
    import kfac_ref

    yield kfac_ref
    for info in pkgutil.walk_packages(kfac_ref.__path__, "kfac_ref."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            yield importlib.import_module(info.name)


def _canonical_names() -> dict[int, tuple[str, object]]:
    """id(object) → (dotted name in its home module, object), for every public function and
    class: the one public module other than the top level whose ``__all__`` lists it (the
    module its docs page lives in); the top level for what only the top level exports."""
    found: dict[int, tuple[str, object]] = {}
    for mod in _public_modules():
        for name in getattr(mod, "__all__", ()):
            obj = getattr(mod, name, None)
            if not callable(obj) or isinstance(obj, type) and issubclass(obj, BaseException):
                continue
            dotted = f"{mod.__name__}.{name}"
            old = found.get(id(obj))
            # its home (a module other than the top level that exports it), under its own
            # name where it also has an alias there
            if (old is None or old[0].count(".") == 1 and dotted.count(".") > 1
                    or old[0].rsplit(".", 1)[0] == mod.__name__
                    and name == getattr(obj, "__name__", None)):
                found[id(obj)] = (dotted, obj)
    return found


_TABLE: dict[str, Support] | None = None


def support_table() -> dict[str, Support]:
    r"""Every public function and class, by the dotted name of its documentation page,
    with its declared :class:`Support`.

    .. math::

       \{\, \text{name}(f) \mapsto \text{Support}(f) \;:\; f \in \text{public API} \,\}
    """
    global _TABLE
    if _TABLE is None:
        table = {dotted: _EAGER for dotted, _ in sorted(_canonical_names().values())}
        for dotted, declared in _DECLARED.items():
            if dotted in table:  # a stale name is reported by unknown_declarations()
                states = {c: v if isinstance(v, str) else v[0] for c, v in declared.items()}
                reasons = {c: v[1] for c, v in declared.items() if not isinstance(v, str)}
                table[dotted] = table[dotted].with_states(reasons, **states)
        _TABLE = table
    return _TABLE


def unknown_declarations() -> list[str]:
    """Declared names that are not public objects (a renamed or moved object); the test
    suite requires this to be empty."""
    return sorted(set(_DECLARED) - set(support_table()))


def support_of(obj) -> Support:
    r"""The declared :class:`Support` of a public function or class (or of its dotted
    name).

    .. math::

       \text{support\_of}(f) = \text{support\_table}()[\text{name}(f)]
    """
    table = support_table()
    if isinstance(obj, str):
        if obj not in table:
            raise _unknown_name("support_of", "obj", obj, tuple(table),
                                "the dotted name of a public function or class of kfac_ref")
        return table[obj]
    entry = _canonical_names().get(id(obj))
    if entry is None:
        raise KFACValueError(f"support_of: obj must be a public function or class of kfac_ref "
                             f"or its dotted name; got {describe(obj)}.")
    return table[entry[0]]


def _unknown_name(func, name, value, known, expected):
    """The error for a name that is not in ``known``: the closest known names (by
    ``difflib``'s similarity ratio; for a dotted name in a known module, the closest names
    of that module) are suggested, and the known names are listed when they are few (for a
    dotted name without a close match, those of its module)."""
    import difflib

    module, _, leaf = value.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in known if module and k.startswith(module + ".")}
    if siblings:  # a known module: the closest names in it, compared by their last part
        close = [siblings[c] for c in difflib.get_close_matches(leaf, siblings, n=3,
                                                                 cutoff=0.6)]
    else:
        close = difflib.get_close_matches(value, known, n=3, cutoff=0.6)
    hint = " Did you mean " + " or ".join(repr(c) for c in close) + "?" if close else ""
    if len(known) <= 12:
        hint += " The known names are " + ", ".join(repr(k) for k in known) + "."
    elif siblings and not close:
        hint += f" The names in {module} are " + ", ".join(sorted(siblings)) + "."
    elif not close:
        hint += " support_table() lists every name."
    return KFACValueError(f"{func}: {name} must be {expected}; got {value!r}.{hint}")


_SYMBOL = {"yes": "yes", "no": "no", "untested": "–", "n/a": "n/a"}


def docstring_row(support: Support) -> str:
    """The reST lines appended to a public docstring: one line per state."""
    groups = {s: [c for c in COLUMNS if support.state(c) == s] for s in _STATES}
    lines = ["", "", ".. rubric:: Backend support", ""]
    if groups["yes"]:
        lines.append("Supported and tested: " + ", ".join(
            "cupy (on a CUDA GPU)" if c == "cupy" else c for c in groups["yes"]) + ".")
    for col in groups["no"]:
        lines.append(f"Not supported: {col} ({support.reasons.get(col, 'see the docs')}).")
    if groups["untested"]:
        lines.append("Not tested: " + ", ".join(groups["untested"]) + ".")
    if groups["n/a"]:
        lines.append("Takes no arrays: any array library.")
    lines.append("See the docs page *Backend support*.")
    return "\n".join(lines) + "\n"


def annotate_docstrings() -> None:
    """Append each public object's support row to its docstring (once; called by
    ``kfac_ref/__init__.py``, not part of the public API)."""
    for dotted, obj in _canonical_names().values():
        doc = obj.__doc__ or ""
        if ".. rubric:: Backend support" in doc:
            continue
        try:
            obj.__doc__ = _dedented(doc) + docstring_row(support_table()[dotted])
        except (AttributeError, TypeError):  # builtins and slots that refuse a new __doc__
            continue


def _dedented(doc: str) -> str:
    import inspect

    return inspect.cleandoc(doc)
