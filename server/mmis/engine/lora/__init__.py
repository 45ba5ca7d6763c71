"""Multi-LoRA (issue 47): PEFT adapters served side by side in one batch, on the language
model's projections and, where an adapter has weights there, the vision tower and projector.

One concept per file: ``errors.py`` (the typed refusals, each with its wire ``code``),
``adapter.py`` (reading and validating a PEFT directory), ``residency.py`` (torch-free:
``--max-loras`` device slots and ``--max-cpu-loras`` host copies, LRU, pins),
``layer.py`` (the wrapped projection and the grouped apply), ``manager.py`` (one model's LoRA
state: wrapping, registering, slot loading).

This package imports nothing at package level, so the torch-free scheduler may import
``mmis.engine.lora.residency`` and ``mmis.engine.lora.errors``.

The engine interface (what the front end's API, the operator and the runner call; settings
``--enable-lora`` (off), ``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras`` on
``EngineConfig``, vLLM's names; under ``--tensor-parallel-size`` > 1 each rank holds its share
of every adapter, split as the engine splits the projection: ``layer.py``, ``manager.py``):

- ``slot_bytes(model, max_loras=, max_rank=, shards=)``: the bytes the manager's slots will
  take, which KV sizing holds aside (``engine/execution/kv_sizing.py``).
- ``LoRAManager(model, max_loras=, max_rank=, max_cpu_loras=)`` wraps the model once at load
  (before the CUDA fusion of ``execution/model/fused.py``, which then leaves wrapped groups
  unfused; after or before the CPU's ``pack_linears``, whose modules it wraps as they are).
- ``add(name, lora_id, path) -> Registered`` validates and registers (raises
  ``LoRAFileError`` / ``LoRAConfigError`` / ``LoRARankError`` / ``LoRATargetError``, all
  ``LoRAError``, a ``ValueError``); ``remove(name)``; ``registered()``. ``lora_id`` is the
  positive int vLLM's KV events carry as ``lora_id`` (the API assigns it; 0 / ``None`` = base).
- Per step: ``acquire(name) -> slot`` for each distinct adapter of the step (pins it),
  ``lm_rows.select(per_sequence_slots, repeats=tokens_per_sequence, dtype=, device=)``
  (or one slot per token without ``repeats``) before the language-model forward,
  ``tower_rows.select([slot], dtype=, device=)`` before each encoder call of one adapter's
  images (``[0]``: base), ``release(name)`` when a request finishes.
- ``changes_tower(name)``: whether an image's encoder output under ``name`` differs from the
  base's (the encoder-cache key and ``mm_hash`` must then include the adapter).
- The scheduler keeps at most ``max_loras`` distinct adapters among its running requests
  (``SchedulerConfig.max_loras``), so a step's adapters always fit the slots.

Wired (this session): ``EngineCoreRequest.lora_name`` / ``lora_id`` (protocol v8, appended with
defaults); ``make_core`` builds the manager under ``--enable-lora`` (and ``load_model`` then
skips the CUDA projection fusion); the core refuses a request whose adapter is not loaded
(``lora_not_loaded``), has another id (``lora_id_mismatch``), or changes the tower while its
images come pre-encoded (E/PD, ``invalid_request``); it keys a tower adapter's items
``<mm_hash>+lora<id>`` (``scheduling/request.py`` ``encoder_key``); prefix-cache keys chain
from ``lora_root(id)`` (``protocol/block_keys.py``); KV events carry ``lora_id`` /
``lora_name``. The engine's utility calls for P0's API: ``load_lora_adapter(name, lora_id,
path)`` -> ``{name, lora_id, tower}``, ``unload_lora_adapter(name)`` (refused while a live
request uses it), ``list_lora_adapters()`` -> ``[{name, lora_id, path, tower}]``; a refusal
comes back as the utility's error with its class's code (``lora_invalid``,
``lora_already_loaded``, ``lora_id_reused``, ``lora_not_loaded``, ``lora_in_use``; an engine
without ``--enable-lora`` answers ``unknown_utility``) and a message starting with the cause.
P0 must assign ids that are never reused in an engine's life and compute block keys with
``block_keys.chain(..., lora_id=...)`` for routing.
"""
