"""Deliberately wrong implementations: the suite's teeth.

Each mutant is the kfac_ref adapter with ONE known pitfall built in.  ``EXPECTED`` on each
class maps the capabilities it breaks to the pitfall id the diagnosis must report;
every other capability must still pass.  ``tests/conformance/test_conformance_mutants.py``
runs them all in CI.  Run one by hand with ``python -m conformance --adapter mutant_kron_swapped``.
"""
