"""Multi-LoRA (issue 47): PEFT adapters served side by side in one batch, on the language
model's projections and, where an adapter has weights there, the vision tower and projector.

One concept per file: ``errors.py`` (the typed refusals, each a 400 at the API),
``adapter.py`` (reading and validating a PEFT directory), ``residency.py`` (torch-free:
``--max-loras`` device slots and ``--max-cpu-loras`` host copies, LRU, pins),
``layer.py`` (the wrapped projection and the grouped apply), ``manager.py`` (one model's LoRA
state: wrapping, registering, slot loading).

This package imports nothing at package level, so the torch-free scheduler may import
``mmis.engine.lora.residency`` and ``mmis.engine.lora.errors``.

The engine interface (what the front end's API, the operator and the runner call; settings
``--enable-lora`` (off), ``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras`` on
``EngineConfig``, vLLM's names; LoRA with ``--tensor-parallel-size`` > 1 is refused at
configuration time for now):

- ``LoRAManager(model, max_loras=, max_rank=, max_cpu_loras=)`` wraps the model once at load
  (before the CUDA fusion of ``execution/model/fused.py``, which then leaves wrapped groups
  unfused; after or before the CPU's ``pack_linears``, whose modules it wraps as they are).
- ``add(name, lora_id, path) -> Registered`` validates and registers (raises
  ``LoRAFileError`` / ``LoRAConfigError`` / ``LoRARankError`` / ``LoRATargetError``, all
  ``LoRAError``, a ``ValueError``); ``remove(name)``; ``registered()``. ``lora_id`` is the
  positive int vLLM's KV events carry as ``lora_id`` (the API assigns it; 0 / ``None`` = base).
- Per step: ``acquire(name) -> slot`` for each distinct adapter of the step (pins it),
  ``lm_rows.select(per_token_slots, dtype=, device=)`` before the language-model forward,
  ``tower_rows.select([slot], dtype=, device=)`` before each encoder call of one adapter's
  images (``[0]``: base), ``release(name)`` when a request finishes.
- ``changes_tower(name)``: whether an image's encoder output under ``name`` differs from the
  base's (the encoder-cache key and ``mm_hash`` must then include the adapter).
- The scheduler asks ``SlotTable.can_run(names)`` whether a step's distinct adapters fit.
"""
