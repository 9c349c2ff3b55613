"""Peer environments, reproduction scripts and findings (see FINDINGS.md).

``common`` holds the fixed float64 problems and their reference K-FAC quantities, computed
with :mod:`kfac_ref.linalg` from per-example activations and back-propagated vectors that are
written out explicitly in NumPy.  Each ``repro_<peer>.py`` runs inside that peer's virtual
environment (recipes in ``<env>.txt``) and prints one line per compared quantity.
"""
