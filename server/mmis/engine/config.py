"""P1's settings: the one frozen :class:`EngineConfig` of ``mmis engine``.

Invariants:
- Every P1 setting is one field here (``mmis.config.setting``: one default, help, rule); the
  ``mmis engine`` flags, ``MMIS_ENGINE_<FIELD>``, ``mmis serve``'s engine-only flags and
  ``SchedulerConfig``'s defaults derive from it; what P0 must agree on is ``shared``.
- A value that cannot work raises :class:`~mmis.config.ConfigError`, naming the flag.
- The KV pool's size: ``--num-kv-blocks`` wins, then ``--kv-cache-gb``, then
  ``--gpu-memory-utilization`` (CUDA only; :data:`DEFAULT_GPU_MEMORY_UTILIZATION` there when
  no KV flag is given), else :data:`DEFAULT_KV_BLOCKS` (``engine/execution/kv_sizing.py`` resolves
  it, and ``engine/execution/dtype.py`` the ``--dtype``, once the model's device is known).
- ``max_num_seqs`` / ``max_num_batched_tokens`` left ``None`` are chosen at start-up
  (``engine/batch_limits.py``: fixed on CPU, from the KV sizing profile on CUDA).
"""

from __future__ import annotations

import dataclasses

from mmis.config import AT_LEAST_1, POSITIVE, ConfigError, GiB, check, setting, shared
from mmis.engine.batch_limits import (
    CPU_MAX_NUM_BATCHED_TOKENS,
    FIXED_MAX_NUM_BATCHED_TOKENS,
    FIXED_MAX_NUM_SEQS,
    MAX_AUTO_SEQS,
    STEP_TOKEN_CHOICES,
)

DEFAULT_MODEL = "mmis-tiny"
DEFAULT_KV_BLOCKS = 2048  # the KV pool's size when no KV sizing setting applies
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # on CUDA when no KV sizing flag is given
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
CPU_LINEAR_CHOICES = ("auto", "onednn", "torch")  # engine/execution/cpu_linear.py
ATTENTION_CHOICES = ("auto", "flex", "torch")  # engine/execution/attn_backends.py
ASYNC_SCHEDULING_CHOICES = ("auto", "on", "off")  # engine/core.py
MIN_ENCODER_CACHE_TOKENS = 8192  # the encoder cache's floor when sized from the processor


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
        0.0,
        rule=(lambda v: 0.0 <= v <= 1.0, "must be within [0, 1]"),
        help="OPERATOR-ONLY fault injection: P1 evicts this fraction of cached items",
    )
    max_num_seqs: int | None = setting(
        None,
        rule=(lambda v: v is None or v >= 1, "must be at least 1"),
        help=f"most requests running at once in P1; default: {FIXED_MAX_NUM_SEQS}, or on CUDA "
        f"with the KV cache sized from memory its tokens / 256 within [{FIXED_MAX_NUM_SEQS}, "
        f"{MAX_AUTO_SEQS}]",
    )
    max_num_batched_tokens: int | None = setting(
        None,
        rule=(lambda v: v is None or v >= 1, "must be at least 1"),
        help=f"tokens computed per engine step at most; default: {CPU_MAX_NUM_BATCHED_TOKENS} on "
        f"CPU, {FIXED_MAX_NUM_BATCHED_TOKENS} on CUDA with a fixed KV pool, or on CUDA with the "
        "KV cache sized from memory the largest of "
        f"{', '.join(map(str, STEP_TOKEN_CHOICES))} whose profiling step's activations take at "
        "most 1/8 of the memory left for KV and activations",
    )
    kv_cache_gb: float | None = setting(
        None,
        rule=(POSITIVE[0], "must be positive"),
        help="KV cache memory in GiB (overrides --gpu-memory-utilization; the way to size "
        "it on CPU)",
    )
    gpu_memory_utilization: float | None = setting(
        None,
        metavar="FRACTION",
        rule=(lambda v: v is None or 0.0 < v <= 1.0, "must be within (0, 1]"),
        help="CUDA only: the fraction of the GPU's memory P1 may use; the KV cache gets what "
        "is left after the weights and a profiling step at --max-num-batched-tokens "
        f"(default on CUDA with no other KV sizing flag: {DEFAULT_GPU_MEMORY_UTILIZATION}; "
        f"on CPU {DEFAULT_KV_BLOCKS} blocks)",
    )
    num_kv_blocks: int | None = setting(
        None,
        rule=(lambda v: v is None or v >= 2, "must be at least 2 (block 0 is reserved)"),
        help="KV cache size in blocks, block 0 included (overrides --kv-cache-gb; with "
        f"neither, {DEFAULT_KV_BLOCKS} on CPU, --gpu-memory-utilization on CUDA)",
    )
    block_size: int = setting(16, rule=AT_LEAST_1, help="tokens per KV block")
    attention_backend: str = setting(
        "auto",
        choices=ATTENTION_CHOICES,
        metavar="{" + ",".join(ATTENTION_CHOICES) + "}",
        rule=(
            lambda v: v in ATTENTION_CHOICES,
            f"must be one of {', '.join(ATTENTION_CHOICES)}",
        ),
        help="the language model's attention (engine/execution/attn_backends.py); auto: on "
        "CUDA FlexAttention reading the KV pages in place, else a varlen flash kernel, else "
        "torch SDPA, each after a start-up probe; on CPU torch SDPA; flex: FlexAttention "
        "(compiled) or refuse to start; torch: torch SDPA",
    )
    encoder_cache_tokens: int | None = setting(
        None,
        rule=(lambda v: v is None or v >= 1, "must be at least 1"),
        help="encoder outputs P1 caches, in placeholder tokens (also the most it encodes in one "
        "step); default: the largest image the model's image processor makes, at least "
        f"{MIN_ENCODER_CACHE_TOKENS}",
    )
    enable_prefix_caching: bool = setting(
        True, flags=("--no-prefix-caching",), help="do not reuse the KV blocks of shared prefixes"
    )
    self_check: bool = setting(
        True,
        flags=("--no-self-check",),
        help="skip the start-up check that one prompt's log-probabilities through the engine "
        "equal the plain transformers forward's (engine/self_check.py)",
    )
    enforce_eager: bool = setting(
        False,
        help="do not capture CUDA graphs: on CUDA, P1 captures one per decode batch size at "
        "start-up (verified against eager) and replays them for decode-only steps; this runs "
        "every step eager (CPU never captures)",
    )
    async_scheduling: str = setting(
        "auto",
        choices=ASYNC_SCHEDULING_CHOICES,
        metavar="{" + ",".join(ASYNC_SCHEDULING_CHOICES) + "}",
        rule=(
            lambda v: v in ASYNC_SCHEDULING_CHOICES,
            f"must be one of {', '.join(ASYNC_SCHEDULING_CHOICES)}",
        ),
        help="schedule the next engine step while the current one runs on the device, its "
        "sampled tokens copied back on a copy stream (engine/core.py; the same tokens as the "
        "synchronous loop); auto: on on CUDA, off elsewhere (no overlap to gain on CPU)",
    )
    max_model_len: int | None = shared(
        "max_model_len", rule=(lambda v: v is None or v >= 2, "must be at least 2")
    )
    device: str | None = setting(None, help="torch device (default: cuda if available, else cpu)")
    threads: int | None = setting(
        None,
        rule=(lambda v: v is None or v >= 1, "must be at least 1"),
        help="P1's torch compute (intra-op) threads, shared by its tensor-parallel ranks; "
        "default: OMP_NUM_THREADS if set, else the CPUs the process may use (affinity and "
        "cgroup CPU quota: mmis/cpus.py) less one per front-end process under mmis serve",
    )
    tensor_parallel_size: int = setting(
        1,
        rule=AT_LEAST_1,
        help="ranks the language model's layers are split over, one process each (on CUDA "
        "one GPU each, NCCL; on CPU gloo)",
    )
    dtype: str = setting(
        "auto",
        choices=DTYPE_CHOICES,
        metavar="{" + ",".join(DTYPE_CHOICES) + "}",
        rule=(lambda v: v in DTYPE_CHOICES, f"must be one of {', '.join(DTYPE_CHOICES)}"),
        help="weights and KV cache dtype; auto: the checkpoint's on CUDA, on CPU bfloat16 "
        "where the CPU has AMX/AVX512-BF16 and a bfloat16 matmul measures faster at start-up, "
        "else float32",
    )
    cpu_linear: str = setting(
        "auto",
        choices=CPU_LINEAR_CHOICES,
        metavar="{" + ",".join(CPU_LINEAR_CHOICES) + "}",
        rule=(
            lambda v: v in CPU_LINEAR_CHOICES,
            f"must be one of {', '.join(CPU_LINEAR_CHOICES)}",
        ),
        help="CPU only: the language model's linears on oneDNN with prepacked weights "
        "(engine/execution/cpu_linear.py); auto: per weight shape, where it measures faster "
        "than torch's at start-up; onednn: all; torch: none",
    )
    health_port: int | None = setting(
        None,
        rule=(lambda v: v is None or 0 <= v <= 65535, "must be a port number"),
        help="serve GET /health on this port once the model is loaded (the engine "
        "container's probes); none by default",
    )
    status_file: str | None = setting(
        None,
        metavar="PATH",
        help="write 'ready' to this file once the engine serves, or why its start failed in one "
        "line (mmis serve reads it to tell a failed start from a crash); none by default",
    )
    seed: int | None = setting(None, help="seed of P1's fault-injection random numbers")
    grammar_cache_size: int = setting(
        64,
        rule=AT_LEAST_1,
        help="compiled structured-output grammars P1 keeps (the least recently used goes)",
    )
    kv_events_endpoint: str | None = setting(
        None,
        metavar="ZMQ_ENDPOINT",
        help="publish prefix-cache events in vLLM's KV-events format on this ZMQ PUB endpoint "
        "(e.g. tcp://*:5557; docs/ROUTING.md); none by default",
    )
    kv_events_replay_endpoint: str | None = setting(
        None,
        metavar="ZMQ_ENDPOINT",
        help="answer replay requests for missed event batches on this ZMQ ROUTER endpoint "
        "(with --kv-events-endpoint); none by default",
    )
    mm_events_endpoint: str | None = setting(
        None,
        metavar="ZMQ_ENDPOINT",
        help="publish the multimodal cache's item stored / evicted events (mmis's own, "
        "framed like the KV events) on this ZMQ PUB endpoint (docs/ROUTING.md); none by default",
    )
    mm_events_replay_endpoint: str | None = setting(
        None,
        metavar="ZMQ_ENDPOINT",
        help="answer replay requests for missed multimodal event batches on this ZMQ ROUTER "
        "endpoint (with --mm-events-endpoint); none by default",
    )
    kv_events_token_ids: bool = setting(
        False,
        help="put each block's token ids in the KV events' BlockStored (vLLM's field, empty by "
        "default): that is the prompt in clear text to every subscriber; only for a vLLM tool "
        "that recomputes block hashes from tokens, on a network you trust",
    )
    events_token: str | None = setting(
        None,
        metavar="TOKEN",
        rule=(
            lambda v: v is None or 1 <= len(v.encode()) <= 255,
            "must be 1 to 255 bytes (a ZMQ PLAIN password)",
        ),
        help="the password (user 'mmis') every peer of the event sockets must present: they "
        "become ZMQ PLAIN servers (docs/SECURITY.md); without it an event endpoint may bind a "
        "loopback address only; set it through the environment (MMIS_ENGINE_EVENTS_TOKEN): a "
        "flag shows in the process list",
    )
    enable_lora: bool = setting(
        False,
        help="serve PEFT LoRA adapters (engine/lora/): several in one batch, on the language "
        "model's projections and, where an adapter targets them, the vision tower and projector",
    )
    max_loras: int = setting(
        1,
        rule=AT_LEAST_1,
        help="LoRA adapters resident on the device at once (distinct adapters in one step; "
        "with --enable-lora)",
    )
    max_lora_rank: int = setting(
        16,
        rule=AT_LEAST_1,
        help="the highest LoRA rank an adapter may have (the device slots are this wide; "
        "with --enable-lora)",
    )
    max_cpu_loras: int | None = setting(
        None,
        rule=(lambda v: v is None or v >= 1, "must be at least 1"),
        help="LoRA adapters kept in host memory (the least recently used goes); default: "
        "--max-loras; never fewer than --max-loras",
    )
    otlp_traces_endpoint: str | None = shared("otlp_traces_endpoint")
    log_level: str = shared("log_level")

    def __post_init__(self) -> None:
        check(self)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(
                f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras "
                f"({self.max_loras})"
            )

    def kv_pool_size(self) -> tuple[int | None, int | None]:
        """``(num_blocks, budget_bytes)`` for the KV pool: the block count wins, then the GiB
        budget, then :data:`DEFAULT_KV_BLOCKS` (``--gpu-memory-utilization`` comes before the
        default on CUDA: ``engine/execution/kv_sizing.py``)."""
        if self.num_kv_blocks is None and self.kv_cache_gb is None:
            return DEFAULT_KV_BLOCKS, None
        budget = None if self.kv_cache_gb is None else int(self.kv_cache_gb * GiB)
        return self.num_kv_blocks, budget
