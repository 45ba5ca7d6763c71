"""P1's settings: the one frozen :class:`EngineConfig` of ``mmis engine``.

Invariants:
- Every P1 setting is one field here, with its one default and help (``mmis.config``); the
  ``mmis engine`` flags, the ``MMIS_ENGINE_<FIELD>`` variables, the engine-only flags of
  ``mmis serve`` and :class:`~mmis.engine.sched_config.SchedulerConfig`'s defaults derive
  from it. Settings P0 must agree on (addresses, cache type and budget, ...) are the shared
  definitions of ``mmis.config``.
- A value that cannot work raises :class:`~mmis.config.ConfigError` at construction, naming
  the CLI flag.
- The KV pool is sized by ``kv_cache_gb`` or ``num_kv_blocks`` (see ``mmis.entrypoints.engine``).
"""

from __future__ import annotations

import dataclasses

from mmis.config import ConfigError, flag_of, setting, shared

DEFAULT_MODEL = "mmis-tiny"


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str = setting(
        DEFAULT_MODEL,
        help="model directory or hub id; mmis-tiny / mmis-tiny-qwen2-vl build a tiny random one",
    )
    revision: str | None = shared("revision")
    input_address: str = shared("engine_input_address")
    output_address: str = shared("engine_output_address")
    mm_cache_gb: float = shared("mm_cache_gb", flags=("--engine-mm-cache-gb", "--mm-cache-gb"))
    mm_cache_type: str = shared("mm_cache_type")
    shm_dir: str = shared("shm_dir")
    fault_evict_rate: float = setting(
        0.0, help="OPERATOR-ONLY fault injection: P1 evicts this fraction of cached items"
    )
    max_num_seqs: int = setting(64, help="most requests running at once in P1")
    max_num_batched_tokens: int = setting(2048, help="tokens computed per engine step at most")
    kv_cache_gb: float | None = setting(None, help="KV cache memory in GiB")
    num_kv_blocks: int | None = setting(None, help="KV cache size in blocks (overrides GiB)")
    block_size: int = setting(16, help="tokens per KV block")
    enable_prefix_caching: bool = setting(
        True, flags=("--no-prefix-caching",), help="do not reuse the KV blocks of shared prefixes"
    )
    max_model_len: int | None = shared("max_model_len")
    device: str | None = setting(None, help="torch device (default: cuda if available, else cpu)")
    seed: int | None = setting(None, help="seed of P1's fault-injection random numbers")
    otlp_traces_endpoint: str | None = shared("otlp_traces_endpoint")
    log_level: str = shared("log_level")

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem:
            raise ConfigError(problem)

    def _problem(self) -> str | None:
        """The first setting that cannot work, as a message naming its flag."""

        def flag(name: str) -> str:
            return flag_of(EngineConfig, name)

        if not 0.0 <= self.fault_evict_rate <= 1.0:
            return f"{flag('fault_evict_rate')} must be within [0, 1], got {self.fault_evict_rate}"
        if self.mm_cache_gb < 0:
            return f"{flag('mm_cache_gb')} must be >= 0, got {self.mm_cache_gb}"
        if self.mm_cache_type not in ("lru", "shm"):
            return f"{flag('mm_cache_type')} must be lru or shm, got {self.mm_cache_type!r}"
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            return f"{flag('kv_cache_gb')} must be positive, got {self.kv_cache_gb}"
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            return f"{flag('num_kv_blocks')} must be at least 2 (block 0 is reserved)"
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                return f"{flag(name)} must be at least 1, got {getattr(self, name)}"
        if self.max_model_len is not None and self.max_model_len < 2:
            return f"{flag('max_model_len')} must be at least 2, got {self.max_model_len}"
        return None
