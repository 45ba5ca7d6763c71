"""Telemetry shared by P0 and P1: Prometheus metrics, the drift window, OpenTelemetry tracing.

Modules (import the one you need; this package imports nothing eagerly):

- ``catalog``: every metric's name, type, help and label names — the one source the
  registry, the engine-stats collector, the Grafana dashboard and the alert rules use;
- ``metrics``: :class:`MMISMetrics`, one ``CollectorRegistry`` per process (never the
  ``prometheus_client`` default registry);
- ``engine_stats`` / ``stats_collector``: P1's figures as a plain dict (the ``stats`` utility
  call) and the collector that renders the latest snapshot into P0's ``/metrics``;
- ``drift``: drift rate = drift misses / shadow hits over a sliding window;
- ``lora_info``: ``mmis:lora_requests_info``, the adapters a P0's engine holds (the endpoint
  picker's LoRA affinity);
- ``tracing_config`` / ``tracing``: OpenTelemetry from ``OTEL_*`` plus explicit settings, off
  (a no-op tracer, no SDK import) unless an OTLP endpoint is configured; context propagation
  P0 -> P1 and the cache span events;
- ``genai``: GenAI semantic-convention attribute names;
- ``bundle``: :class:`FrontendTelemetry`, P0's registry + engine-stats collector + drift
  window wired together.

The Grafana dashboard and the Prometheus rules are generated from the catalog's names by
build tools outside this package (``scripts/dashboards/``, run by ``scripts/gen-dashboard``).

Invariant: nothing here imports ``mmis.frontend``, ``mmis.engine`` or the
operator (import-linter contract), so both processes can use it.
"""
