"""Every mmis metric, declared once: name, type, help, label names, who produces it.

Invariants:
- Names start with ``mmis_`` (or ``mmis:`` for the three gauges the Gateway API inference
  extension's endpoint picker scrapes: ``mmis:num_requests_waiting``,
  ``mmis:num_requests_running``, ``mmis:kv_cache_usage_perc`` — the model-server protocol's
  TotalQueuedRequests / TotalRunningRequests / KVCacheUtilization, all gauges; the KV usage is
  a fraction in [0, 1], as in the ``vllm:kv_cache_usage_perc`` reference metric — for
  ``mmis:lora_requests_info``, the protocol's LoRA metric that the picker's LoRA-affinity
  scorer reads (:mod:`mmis.telemetry.lora_info`), and for ``mmis:uuid_rebinds_total``, the
  name docs/SECURITY.md gives it).
- Counter names end in ``_total``, as they appear in PromQL.
- Label names come from :data:`ALLOWED_LABELS` only, and every label has a closed value set:
  request ids, hashes, uuids or any other per-request value never become a label (checked at
  import time here, and by a test that scans everything a registry exposes). The LoRA labels
  (:data:`LORA_LABELS`) are bounded as ``model`` is, by deployment: the names of the
  adapters the operator loads, never a request's value, one series per P0 at a time.
- ``api_server`` (the P0 process index, "0" .. "63") is on no spec: with ``--api-servers N``
  above 1 every P0 series (all but P1's ``Owner.ENGINE`` figures) gets it at exposition
  (:meth:`~mmis.telemetry.metrics.MMISMetrics.exposition`); with one P0 it is absent, so
  one-process scrapes are what they always were and every query that sums ``by (model)``
  holds for any N.
- ``Owner.ENGINE`` metrics are produced by P1 and reach P0 as a stats snapshot; their
  ``snapshot_key`` names the snapshot field (see :mod:`engine_stats`).
"""

from __future__ import annotations

import dataclasses
import enum

from mmis.telemetry.errors import LabelValueError


class Kind(enum.StrEnum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


class Owner(enum.StrEnum):
    FRONTEND = "p0"  # instantiated in MMISMetrics
    ENGINE = "p1"  # rendered from P1's stats snapshot
    DERIVED = "derived"  # computed in P0 at scrape time (the drift window)
    ENCODER = "encoder"  # exposed by mmis encoder itself (engine/encoder/metrics.py)


# The label names a metric may carry, each with its closed set of values ("model" is fixed per
# process, so it is bounded by deployment, not by traffic).
ENDPOINTS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"}
)
# success: the retry healed it; failed: missed again (503); error: the retry failed otherwise;
# hash_only: the missing items were sent by uuid only, so no retry: refused with a 422.
RETRY_OUTCOMES = frozenset({"success", "failed", "error", "hash_only"})
STATUS_CLASSES = frozenset({"1xx", "2xx", "3xx", "4xx", "5xx"})
# E/PD (issue 46), P0's asks of an encoder per item: ok (encoded for this ask), cached (the
# encoder held it), fallback (P0 sent the pixels: the reason says why)
ENCODER_REQUEST_OUTCOMES = frozenset({"ok", "cached", "fallback"})
ENCODER_FALLBACK_REASONS = frozenset({"timeout", "down", "error", "mislabelled", "none_live"})
# an encoder's items (mmis encoder): encoded by its vision tower, or cached
ENCODER_ITEM_OUTCOMES = frozenset({"encoded", "cached"})
# why P1 refused an encoder output (engine/encoder_inputs.py; the request was a miss)
ENCODER_REJECT_REASONS = ("dtype", "shape", "nonfinite", "pixels")
# the P0 process index under --api-servers N (mmis.frontend.config.MAX_API_SERVERS = 64)
API_SERVER_INDICES = frozenset(str(i) for i in range(64))
# mmis:lora_requests_info (issue 47): vLLM's label names, which the picker's metrics extractor
# reads: the adapters held (names sorted, comma-joined), those waiting (always ""), how many
# it holds
LORA_LABELS = ("running_lora_adapters", "waiting_lora_adapters", "max_lora")
ALLOWED_LABELS = frozenset(
    {"model", "endpoint", "outcome", "status", "api_server", "reason", *LORA_LABELS}
)

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


@dataclasses.dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...]
    owner: Owner
    buckets: tuple[float, ...] = ()
    snapshot_key: str | None = None
    # an engine metric with one more label: its values; the snapshot holds one figure per
    # value, under ``<snapshot_key>_<value>``
    snapshot_labels: tuple[str, ...] = ()

    @property
    def snapshot_keys(self) -> tuple[str, ...]:
        """The engine stats keys this metric reads."""
        if self.snapshot_key is None:
            return ()
        if not self.snapshot_labels:
            return (self.snapshot_key,)
        return tuple(f"{self.snapshot_key}_{value}" for value in self.snapshot_labels)

    @property
    def series_names(self) -> tuple[str, ...]:
        """The sample names this metric exposes (what PromQL selects)."""
        if self.kind is Kind.HISTOGRAM:
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


def _p0(
    name: str, kind: Kind, help_: str, *labels: str, buckets: tuple[float, ...] = ()
) -> MetricSpec:
    return MetricSpec(name, kind, help_, labels, Owner.FRONTEND, buckets)


def _p1(name: str, kind: Kind, help_: str, key: str) -> MetricSpec:
    return MetricSpec(name, kind, help_, ("model",), Owner.ENGINE, snapshot_key=key)


C, G, H = Kind.COUNTER, Kind.GAUGE, Kind.HISTOGRAM
ME = ("model", "endpoint")

REQUESTS = _p0("mmis_requests_total", C, "Requests finished, by HTTP status class.", *ME, "status")
PROMPT_TOKENS = _p0("mmis_prompt_tokens_total", C, "Prompt tokens processed.", "model")
GENERATION_TOKENS = _p0("mmis_generation_tokens_total", C, "Tokens generated.", "model")
REQUEST_LATENCY = _p0(
    "mmis_request_latency_seconds", H, "End-to-end request latency.", *ME, buckets=LATENCY_BUCKETS
)
TTFT = _p0("mmis_time_to_first_token_seconds", H, "Time to first token.", *ME, buckets=TTFT_BUCKETS)
TPOT = _p0(
    "mmis_time_per_output_token_seconds", H, "Time per output token.", *ME, buckets=TPOT_BUCKETS
)
PROCESSOR_CACHE_QUERIES = _p0(
    "mmis_processor_cache_queries_total", C, "P0 multimodal (sender) cache lookups.", "model"
)
PROCESSOR_CACHE_HITS = _p0(
    "mmis_processor_cache_hits_total", C, "P0 multimodal (sender) cache hits.", "model"
)
SHADOW_HITS = _p0(
    "mmis_shadow_hits_total", C, "Items sent without data, trusting P1 to hold them.", "model"
)
DRIFT_MISSES = _p0(
    "mmis_drift_misses_total", C, "Shadow hits P1 reported missing (cache drift).", "model"
)
INVALIDATIONS = _p0(
    "mmis_shadow_invalidations_total", C, "Shadow entries dropped on P1's word.", "model"
)
RETRIES = _p0(
    "mmis_mm_retries_total",
    C,
    "Requests whose first attempt failed retryably (cache miss, P1 restart), by how recovery "
    "ended: success, failed (missed again, 503), error, hash_only (uuid-only items, 422).",
    *ME,
    "outcome",
)
ENCODER_REQUESTS = _p0(
    "mmis_encoder_requests_total",
    C,
    "Items P0 asked an encoder for (E/PD), by outcome: ok (encoded), cached (the encoder "
    "held it), fallback (P0 sent the pixels, P1 encoded them).",
    "model",
    "outcome",
)
ENCODER_FALLBACKS = _p0(
    "mmis_encoder_fallbacks_total",
    C,
    "Items P0 sent as pixels although encoders are configured, by reason: timeout, down "
    "(the encoder went away), error (it answered an error), mislabelled (another key or "
    "hash), none_live (no encoder in the live set).",
    "model",
    "reason",
)
UUID_REBINDS = _p0(
    "mmis:uuid_rebinds_total",
    C,
    "Items sent with new data under a uuid their tenant had bound to other content (the "
    "uuid now names the new content for that tenant only).",
    "model",
)

DRIFT_RATE = MetricSpec(
    "mmis_drift_rate",
    G,
    "Drift misses / shadow hits over the drift window.",
    ("model",),
    Owner.DERIVED,
)

LORA_INFO = MetricSpec(
    "mmis:lora_requests_info",
    G,
    "The LoRA adapters this P0's engine holds (with LoRA on only): running_lora_adapters their "
    "names, sorted and comma-joined; waiting_lora_adapters empty; max_lora how many it holds. "
    "The value is the Unix time this P0 first showed that set (the endpoint picker's "
    "LoRA-affinity scorer reads the newest series).",
    ("model", *LORA_LABELS),
    Owner.DERIVED,
)

ENGINE_UP = _p1("mmis_engine_up", G, "1 while P1 answers stats calls, else 0.", "up")
WAITING = _p1("mmis_num_requests_waiting", G, "Requests queued in P1.", "num_requests_waiting")
RUNNING = _p1("mmis_num_requests_running", G, "Requests running in P1.", "num_requests_running")
KV_USAGE = _p1("mmis_kv_cache_usage_perc", G, "KV-cache usage, 0..1 (1 = full).", "kv_cache_usage")
GIE_WAITING = _p1("mmis:num_requests_waiting", G, WAITING.help, "num_requests_waiting")
GIE_RUNNING = _p1("mmis:num_requests_running", G, RUNNING.help, "num_requests_running")
GIE_KV_USAGE = _p1("mmis:kv_cache_usage_perc", G, KV_USAGE.help, "kv_cache_usage")
ENCODER_QUERIES = _p1(
    "mmis_encoder_cache_queries_total", C, "Encoder cache lookups.", "encoder_cache_queries"
)
ENCODER_HITS = _p1("mmis_encoder_cache_hits_total", C, "Encoder cache hits.", "encoder_cache_hits")
ENCODER_EVICTIONS = _p1(
    "mmis_encoder_cache_evictions_total", C, "Encoder cache evictions.", "encoder_cache_evictions"
)
PREFIX_QUERIES = _p1(
    "mmis_prefix_cache_queries_total",
    C,
    "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_queries",
)
PREFIX_HITS = _p1(
    "mmis_prefix_cache_hits_total",
    C,
    "Prompt tokens found in the prefix cache.",
    "prefix_cache_hits",
)
RECEIVER_QUERIES = _p1(
    "mmis_receiver_cache_queries_total",
    C,
    "P1 multimodal (receiver) cache lookups.",
    "receiver_cache_queries",
)
RECEIVER_HITS = _p1(
    "mmis_receiver_cache_hits_total",
    C,
    "P1 multimodal (receiver) cache hits.",
    "receiver_cache_hits",
)
RECEIVER_EVICTIONS = _p1(
    "mmis_receiver_cache_evictions_total",
    C,
    "P1 multimodal (receiver) cache evictions.",
    "receiver_cache_evictions",
)
RECEIVER_STORES = _p1(
    "mmis_receiver_cache_stores_total",
    C,
    "Items P1's receiver cache stored (sent with data by some P0; shared by every P0).",
    "receiver_cache_stores",
)
ENCODER_OUTPUTS_REJECTED = MetricSpec(
    "mmis_encoder_outputs_rejected_total",
    C,
    "Encoder outputs P1 refused, by reason (dtype, shape, nonfinite, pixels): each was "
    "answered as a receiver-cache miss, so P0 resent the pixels.",
    ("model", "reason"),
    Owner.ENGINE,
    snapshot_key="encoder_outputs_rejected",
    snapshot_labels=ENCODER_REJECT_REASONS,
)
ENCODER_ITEMS = MetricSpec(
    "mmis_encoder_items_total",
    C,
    "Items an encoder (mmis encoder) answered with an output, by outcome: encoded (by the "
    "vision tower) or cached (from its output cache).",
    ("model", "outcome"),
    Owner.ENCODER,
)
ENCODER_CACHE_BYTES = MetricSpec(
    "mmis_encoder_cache_bytes",
    G,
    "Bytes of encoder outputs an encoder's output cache holds.",
    ("model",),
    Owner.ENCODER,
)
ENCODER_QUEUE_ITEMS = MetricSpec(
    "mmis_encoder_queue_items",
    G,
    "Items an encoder has to encode: queued plus the batch its vision tower runs (the encoder "
    "autoscaler's metric, operator/mmis_operator/spec.py ENCODER_QUEUE).",
    ("model",),
    Owner.ENCODER,
)

ALL: tuple[MetricSpec, ...] = tuple(
    v for v in list(globals().values()) if isinstance(v, MetricSpec)
)
BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in ALL}


def series_names() -> frozenset[str]:
    """Every sample name mmis exposes (what dashboards and alert rules may select)."""
    return frozenset(name for spec in ALL for name in spec.series_names)


def check_label(name: str, value: str) -> str:
    """Return ``value`` if it belongs to the closed set of label ``name``, else raise."""
    allowed = {
        "endpoint": ENDPOINTS,
        "outcome": RETRY_OUTCOMES | ENCODER_REQUEST_OUTCOMES | ENCODER_ITEM_OUTCOMES,
        "reason": ENCODER_FALLBACK_REASONS | frozenset(ENCODER_REJECT_REASONS),
        "status": STATUS_CLASSES,
        "api_server": API_SERVER_INDICES,
    }.get(name)
    if allowed is not None and value not in allowed:
        raise LabelValueError(f"label {name}={value!r} is not one of {sorted(allowed)}")
    return value


def _validate() -> None:
    if len(BY_NAME) != len(ALL):
        raise RuntimeError("duplicate metric name in the catalog")
    for spec in ALL:
        if not spec.name.startswith(("mmis_", "mmis:")):
            raise RuntimeError(f"{spec.name}: metric names start with mmis_ or mmis:")
        if (spec.kind is Kind.COUNTER) != spec.name.endswith("_total"):
            raise RuntimeError(f"{spec.name}: counters, and only counters, end in _total")
        if not set(spec.labels) <= ALLOWED_LABELS:
            raise RuntimeError(f"{spec.name}: labels {spec.labels} outside {ALLOWED_LABELS}")
        if (spec.owner is Owner.ENGINE) != (spec.snapshot_key is not None):
            raise RuntimeError(f"{spec.name}: engine metrics, and only those, need a snapshot key")


_validate()
