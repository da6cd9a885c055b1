"""Benchmarks against peers and physical limits (``python -m cluster bench ...``).

A regular package so that ``tests/benchmarks`` (on pytest's path) cannot shadow it.
"""
