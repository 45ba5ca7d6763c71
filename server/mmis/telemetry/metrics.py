"""The per-process metrics registry: P0's counters and histograms, and the exposition.

Invariants:
- Each :class:`MMISMetrics` owns its own ``CollectorRegistry``; nothing is ever registered in
  ``prometheus_client.REGISTRY``, so two instances (two tests, two P0s in one process) never
  collide and nothing leaks between tests.
- Metrics are built from :mod:`catalog` (``Owner.FRONTEND`` specs); the ``model`` label is
  fixed at construction, every other label value is checked against its closed set, so no
  request id or hash can become a label.
- Counters are born at 0: the model-only ones and ``mmis_mm_retries_total`` for every
  (endpoint, outcome) exist from the first scrape, so ``increase()``/``rate()`` (and the
  alerts built on them) see the first increment; a series born at 1 would show no increase.
- P1's figures are not instruments here: :meth:`attach` adds collectors (the engine-stats
  snapshot, the drift window) that render at scrape time.
- ``exposition(accept, api_server="i")`` (one of N P0 processes, ``--api-servers``) adds the
  label ``api_server="i"`` to every family but P1's (:data:`ENGINE_FAMILIES`): the P0 series
  of N processes never collide when merged (:mod:`mmis.telemetry.aggregate`), and a restarted
  process's counters reset its own series only. Without it the exposition is unchanged.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from mmis.telemetry import catalog
from mmis.telemetry.catalog import Kind, MetricSpec, Owner, check_label
from mmis.telemetry.errors import TelemetryError

ENGINE_FAMILIES = frozenset(
    spec.name.removesuffix("_total") if spec.kind is Kind.COUNTER else spec.name
    for spec in catalog.ALL
    if spec.owner is Owner.ENGINE
)
"""The metric-family names of P1's figures (a counter's family name drops ``_total``): they
carry no ``api_server`` label and appear once in a merged exposition."""


def with_label(family: Metric, name: str, value: str) -> Metric:
    """A copy of ``family`` whose every sample also carries ``name="value"``."""
    out = Metric(family.name, family.documentation, family.type, family.unit)
    out.samples = [s._replace(labels={**s.labels, name: value}) for s in family.samples]
    return out


class Families(Collector):
    """A fixed list of metric families (an exposition to encode)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return iter(self._families)


def encode(families: Iterable[Metric], accept: str | None) -> tuple[bytes, str]:
    """``families`` as a ``/metrics`` body and its content type, negotiated from ``Accept``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families(families))
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type


def counter_value(counter: Counter, **labels: str) -> float:
    """Sum of a counter over its label sets that include ``labels`` (0.0 before any)."""
    wanted = labels.items()
    return sum(
        sample.value
        for family in counter.collect()
        for sample in family.samples
        if sample.name.endswith("_total") and wanted <= sample.labels.items()
    )


class MMISMetrics:
    """All metrics of one process, in one private registry."""

    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        if not model:
            raise TelemetryError("MMISMetrics needs the served model's name for the model label")
        self.model = model
        self.registry = registry if registry is not None else CollectorRegistry()
        self._instruments: dict[str, Counter | Histogram] = {}
        for spec in catalog.ALL:
            if spec.owner is Owner.FRONTEND:
                self._instruments[spec.name] = self._build(spec)
                if spec.kind is Kind.COUNTER and spec.labels == ("model",):
                    self._counter(spec).labels(model=model)
        for endpoint, outcome in itertools.product(catalog.ENDPOINTS, catalog.RETRY_OUTCOMES):
            self._counter(catalog.RETRIES).labels(model=model, endpoint=endpoint, outcome=outcome)

    def _build(self, spec: MetricSpec) -> Counter | Histogram:
        if spec.kind is Kind.COUNTER:
            return Counter(spec.name, spec.help, spec.labels, registry=self.registry)
        if spec.kind is Kind.HISTOGRAM:
            return Histogram(
                spec.name, spec.help, spec.labels, registry=self.registry, buckets=spec.buckets
            )
        raise TelemetryError(f"{spec.name}: P0 instruments are counters or histograms")

    def attach(self, collector: Collector) -> None:
        """Register a scrape-time collector (engine stats snapshot, drift window)."""
        self.registry.register(collector)

    def _counter(self, spec: MetricSpec) -> Counter:
        instrument = self._instruments[spec.name]
        if not isinstance(instrument, Counter):
            raise TelemetryError(f"{spec.name} is not a counter")
        return instrument

    def _histogram(self, spec: MetricSpec) -> Histogram:
        instrument = self._instruments[spec.name]
        if not isinstance(instrument, Histogram):
            raise TelemetryError(f"{spec.name} is not a histogram")
        return instrument

    def _inc(self, spec: MetricSpec, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise TelemetryError(f"{spec.name}: counters only go up (got {amount})")
        if amount:
            values = {name: check_label(name, value) for name, value in labels.items()}
            self._counter(spec).labels(model=self.model, **values).inc(amount)

    # -- the multimodal cache path (P0) -------------------------------------------------

    def processor_cache(self, queries: int, hits: int) -> None:
        """Record ``queries`` sender-cache lookups of which ``hits`` were hits."""
        if hits > queries:
            raise TelemetryError(f"processor cache: {hits} hits exceed {queries} queries")
        self._inc(catalog.PROCESSOR_CACHE_QUERIES, queries)
        self._inc(catalog.PROCESSOR_CACHE_HITS, hits)

    def shadow_hits(self, count: int = 1) -> None:
        self._inc(catalog.SHADOW_HITS, count)

    def drift_misses(self, count: int = 1) -> None:
        self._inc(catalog.DRIFT_MISSES, count)

    def invalidations(self, count: int = 1) -> None:
        self._inc(catalog.INVALIDATIONS, count)

    def uuid_rebinds(self, count: int = 1) -> None:
        """A tenant sent new data under a uuid it had bound to other content."""
        self._inc(catalog.UUID_REBINDS, count)

    def retry(self, endpoint: str, outcome: str) -> None:
        """One request whose first attempt failed retryably, by how its recovery ended.

        ``outcome`` is success | failed (missed again) | error | hash_only (refused with a 422
        naming the uuids the client must resend with data; no retry was possible).
        """
        self._inc(catalog.RETRIES, 1, endpoint=endpoint, outcome=outcome)

    def encoder_request(self, outcome: str, count: int = 1) -> None:
        """``count`` items P0 asked an encoder for (E/PD), by ``outcome``: ok | cached |
        fallback (``catalog.ENCODER_REQUEST_OUTCOMES``)."""
        if outcome not in catalog.ENCODER_REQUEST_OUTCOMES:
            raise TelemetryError(
                f"encoder request outcome {outcome!r} is not one of "
                f"{sorted(catalog.ENCODER_REQUEST_OUTCOMES)}"
            )
        self._inc(catalog.ENCODER_REQUESTS, count, outcome=outcome)

    def encoder_fallback(self, reason: str, count: int = 1) -> None:
        """``count`` items sent as pixels although encoders are configured, by ``reason``
        (``catalog.ENCODER_FALLBACK_REASONS``); each is also an ``encoder_request``
        ``fallback``."""
        self._inc(catalog.ENCODER_FALLBACKS, count, reason=reason)
        self.encoder_request("fallback", count)

    # -- requests ------------------------------------------------------------------------

    def request_finished(
        self,
        endpoint: str,
        status: int,
        latency_s: float,
        prompt_tokens: int = 0,
        generation_tokens: int = 0,
    ) -> None:
        """Count a finished request by status class and observe its end-to-end latency."""
        if not 100 <= status <= 599:
            raise TelemetryError(f"HTTP status {status} is out of range")
        status_class = f"{status // 100}xx"
        self._inc(catalog.REQUESTS, 1, endpoint=endpoint, status=status_class)
        self._inc(catalog.PROMPT_TOKENS, prompt_tokens)
        self._inc(catalog.GENERATION_TOKENS, generation_tokens)
        self._observe(catalog.REQUEST_LATENCY, endpoint, [latency_s])

    def first_token(self, endpoint: str, ttft_s: float) -> None:
        self._observe(catalog.TTFT, endpoint, [ttft_s])

    def output_tokens(self, endpoint: str, per_token_s: Iterable[float]) -> None:
        """Observe the gaps between consecutive output tokens of one request."""
        self._observe(catalog.TPOT, endpoint, per_token_s)

    def _observe(self, spec: MetricSpec, endpoint: str, values: Iterable[float]) -> None:
        child = self._histogram(spec).labels(
            model=self.model, endpoint=check_label("endpoint", endpoint)
        )
        for value in values:
            if value < 0:
                raise TelemetryError(f"{spec.name}: negative duration {value}")
            child.observe(value)

    # -- reading back ----------------------------------------------------------------------

    def total(self, spec: MetricSpec, **labels: str) -> float:
        """Current value of a P0 counter, summed over the label sets that include ``labels``."""
        return counter_value(self._counter(spec), **labels)

    def exposition(
        self, accept: str | None = None, *, api_server: str | None = None
    ) -> tuple[bytes, str]:
        """The ``/metrics`` body and its content type, negotiated from ``Accept``; with
        ``api_server`` every P0 family carries that process index (not P1's figures)."""
        if api_server is None:
            encoder, content_type = choose_encoder(accept or "")
            return encoder(self.registry), content_type
        index = check_label("api_server", api_server)
        return encode(
            (
                f if f.name in ENGINE_FAMILIES else with_label(f, "api_server", index)
                for f in self.registry.collect()
            ),
            accept,
        )
