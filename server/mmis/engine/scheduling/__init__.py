"""P1's scheduling: which requests run in the next step, with how many tokens, in which KV
blocks (``scheduler.py``; its request state in ``request.py``, the step it hands the runner
in ``sched_output.py``, blocks and the prefix cache in ``kv_cache.py``/``block_pool.py``, the
encoder budget in ``encoder_cache.py``/``encoder_plan.py``).

Invariant: torch-free (an import-linter contract in pyproject.toml forbids torch and numpy
here), so the scheduler is tested without a model (tests/engine/test_scheduler*.py).
"""
