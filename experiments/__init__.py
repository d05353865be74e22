"""Correctness studies: how far a way of training is from its reference (the
large batch, Keras' built-in accumulation, another dtype policy), measured on
small models and written up in docs/benchmarks/ (``python -m experiments.<name>``).

What a study shares with the tests (the cases' training code, tolerances) is
in ``tests/support/``; the tests assert it and import nothing from here. The
output helpers (environment, tables, figures) are the benchmarks'.
"""
