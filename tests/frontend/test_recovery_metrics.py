"""Recovery outcomes as P0's ``/metrics`` shows them (``mmis_mm_retries_total``).

The S3 case (a client names an image by uuid only and P1 no longer holds it) is refused with
a 422 and never retried; it must still be counted, as ``outcome="hash_only"``, in the same
family as the other recovery outcomes, by endpoint, with no uuid or hash in any label.
Real P0 over HTTP, real ZMQ, the real P1 shell and receiver cache; only the core is scripted.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import image_part
from scripted_stack import StackFactory

from mmis.frontend.client.recovery import RecoveryPolicy
from mmis.telemetry import catalog
from mmis.telemetry.metrics import MMISMetrics

pytestmark = pytest.mark.timeout(180)

CHAT = "/v1/chat/completions"
RETRIES = "mmis_mm_retries_total"
UUID = "photo-hash-only-7"


def retries_by_outcome(text: str, endpoint: str = CHAT) -> dict[str, float]:
    """``{outcome: value}`` of the retries family for one endpoint, from a text exposition."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == RETRIES and sample.labels.get("endpoint") == endpoint:
                out[sample.labels["outcome"]] = sample.value
    return out


def chat_body(part: dict) -> dict:
    content = [part, {"type": "text", "text": "Describe"}]
    return {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}


def test_a_hash_only_refusal_is_counted_on_metrics_by_endpoint_and_outcome(
    start_stack: StackFactory,
) -> None:
    engine, frontend = start_stack()
    by_uuid = {"type": "image_url", "image_url": {"uuid": UUID}}
    with httpx.Client(base_url=frontend.root_url, timeout=30) as http:
        before = retries_by_outcome(http.get("/metrics").text)
        assert before.get("hash_only") == 0.0  # born at 0, so increase() sees the first one
        sent = http.post(CHAT, json=chat_body(image_part((30, 160, 90), uuid=UUID)))
        assert sent.status_code == 200, sent.text
        engine.evict_all_before_next()  # P1 loses the item; P0's shadow still lists it
        refused = http.post(CHAT, json=chat_body(by_uuid))
        assert refused.status_code == 422, refused.text
        assert refused.json()["error"]["missing_uuids"] == [UUID]
        text = http.get("/metrics").text
    after = retries_by_outcome(text)
    assert after["hash_only"] == 1.0
    # refused without a retry: no other outcome moved
    assert {k: v for k, v in after.items() if k != "hash_only"} == dict.fromkeys(
        catalog.RETRY_OUTCOMES - {"hash_only"}, 0.0
    )
    assert UUID not in text  # never a label value (nor anywhere else on /metrics)


def test_every_recovery_outcome_reaches_the_retries_family() -> None:
    metrics = MMISMetrics("tiny")
    policy = RecoveryPolicy(None, None, metrics)  # type: ignore[arg-type]  # counting only
    for outcome in ("success", "miss_again", "error", "hash_only"):  # what recovery.py counts
        policy._count("chat", outcome, hashes=1)
    policy._count("ready", "success", hashes=1)  # a probe, not a client
    got = retries_by_outcome(metrics.exposition()[0].decode())
    assert got == {"success": 1.0, "failed": 1.0, "error": 1.0, "hash_only": 1.0}
    assert metrics.total(catalog.RETRIES) == 4
