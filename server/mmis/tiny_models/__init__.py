"""Tiny random models built locally from real transformers configs with each family's real
processor settings (``mmis tiny-model``, the tests and the benchmarks use them; no hub access
needed). Not part of the serving path: the engine and the front end never import this package.
"""
