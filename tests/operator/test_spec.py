from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from mmis_operator import spec as specmod
from mmis_operator.spec import InvalidSpecError, parse_spec

CRD = Path(__file__).resolve().parents[2] / "crds" / "mminferenceservice.yaml"


def _crd_defaults(schema: dict[str, Any], path: str = "") -> dict[str, Any]:
    found = {}
    for key, sub in (schema.get("properties") or {}).items():
        where = f"{path}.{key}" if path else key
        if "default" in sub and sub["default"] != {}:
            found[where] = sub["default"]
        found.update(_crd_defaults(sub, where))
    return found


def test_python_defaults_match_the_crd_defaults() -> None:
    crd = yaml.safe_load(CRD.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    defaults = _crd_defaults(schema)
    parsed = parse_spec({"model": {"id": "m"}})
    gi = 2**30
    on = {"enabled": True, "maxReplicas": 2, "target": 1}  # the defaults of an enabled one
    auto = parse_spec({"model": {"id": "m"}, "autoscaling": on}).autoscaling
    assert auto is not None
    routed = parse_spec({"model": {"id": "m"}, "routing": {}}).routing  # the defaults of one
    assert routed is not None and parsed.routing is None
    observed = {
        "replicas": parsed.replicas,
        "image": parsed.image,
        "imagePullPolicy": parsed.image_pull_policy,
        "resources.gpus": parsed.gpus,
        "resources.memory": parsed.engine_memory_bytes / gi,
        "resources.cpu": parsed.engine_cpu,
        "cache.type": parsed.cache.type,
        "cache.size": parsed.cache.size_bytes / gi,
        "cache.driftThreshold": parsed.cache.drift_threshold,
        "telemetry.samplingRatio": parsed.sampling_ratio,
        "service.type": parsed.service_type,
        "service.port": parsed.service_port,
        "ingress.enabled": bool(parsed.ingress.get("enabled")),
        "probes.startupTimeoutSeconds": parsed.startup_timeout_seconds,
        "probes.drainSeconds": parsed.drain_seconds,
        "model.storage.type": parsed.model.storage.type,
        "model.storage.size": parsed.model.storage.size_bytes / gi,
        "model.storage.accessMode": parsed.model.storage.access_mode,
        "rollout.maxSurge": parsed.rollout.max_surge,
        "rollout.maxUnavailable": parsed.rollout.max_unavailable,
        "disruption.enabled": parsed.disruption.enabled,
        "disruption.maxUnavailable": parsed.disruption.max_unavailable,
        "autoscaling.enabled": parsed.autoscaling is not None,
        "autoscaling.minReplicas": auto.min_replicas,
        "autoscaling.metric": auto.metric,
        "autoscaling.scaleUpStabilizationSeconds": auto.scale_up_window_seconds,
        "autoscaling.scaleDownStabilizationSeconds": auto.scale_down_window_seconds,
        "autoscaling.prometheusAddress": auto.prometheus_address,
        "monitoring.podMonitor": parsed.monitoring.pod_monitor,
        "monitoring.scrapeAnnotations": parsed.monitoring.scrape_annotations,
        "monitoring.interval": parsed.monitoring.interval,
        "routing.picker.replicas": routed.replicas,
        "routing.cacheWeight": routed.cache_weight,
    }
    # the CRD writes quantities as strings; compare in GiB
    crd_values = {
        k: (float(v[:-2]) if isinstance(v, str) and v.endswith("Gi") else v)
        for k, v in defaults.items()
    }
    # one home: the CRD's defaults are spec.DEFAULTS, and parse_spec applies them
    assert defaults == specmod.DEFAULTS
    for key in ("auth.apiKeySecretRef.key", "ingress.path", "model.tokenSecretRef.key"):
        crd_values.pop(key)
    assert crd_values == observed
    # the P0 container's requests have none in the CRD (a stored default could not be told
    # from a value written): unset, one process's defaults times apiServers (1 here)
    assert "resources.frontendCpu" not in defaults and "resources.frontendMemory" not in defaults
    assert parsed.api_servers == 1
    assert parsed.frontend_cpu == specmod.PROCESS_DEFAULTS["resources.frontendCpu"] == "2"
    assert parsed.frontend_memory_bytes / gi == 4.0
    # server settings the operator does not need have no default of its own (not passed)
    assert parsed.max_num_seqs is None and parsed.max_num_batched_tokens is None
    assert parsed.cache.drift_window_seconds is None


def test_shm_store_and_volume_sizes() -> None:
    parsed = parse_spec({"model": {"id": "m"}, "cache": {"type": "shm", "size": "4Gi"}})
    assert parsed.cache.shm_store_bytes == 4 * 2**30
    assert parsed.cache.shm_volume_bytes == 4 * 2**30 + specmod.SHM_HEADROOM_MIN
    big = parse_spec(
        {
            "model": {"id": "m"},
            "resources": {"memory": "64Gi"},
            "cache": {"type": "shm", "size": "20Gi"},
        }
    )
    assert big.cache.shm_volume_bytes == 22 * 2**30  # 10% headroom beats the minimum
    lru = parse_spec({"model": {"id": "m"}})
    assert lru.cache.shm_store_bytes == 0
    assert lru.cache.shm_volume_bytes == specmod.SHM_HEADROOM_MIN


@pytest.mark.parametrize(
    ("spec", "field", "words"),
    [
        ({}, "spec.model", "required"),
        ({"model": {}}, "spec.model", "exactly one of id"),
        ({"model": {"id": "a", "path": "/b"}}, "spec.model", "exactly one of id"),
        ({"model": {"path": "rel/dir"}}, "spec.model.path", "absolute"),
        ({"model": {"id": "m"}, "replicas": -1}, "spec.replicas", "at least 0"),
        ({"model": {"id": "m"}, "replicas": "2"}, "spec.replicas", "integer"),
        ({"model": {"id": "m"}, "resources": {"gpus": -2}}, "spec.resources.gpus", "at least 0"),
        (
            {"model": {"id": "m"}, "resources": {"memory": "lots"}},
            "spec.resources.memory",
            "quantity",
        ),
        ({"model": {"id": "m"}, "resources": {"cpu": "0"}}, "spec.resources.cpu", "positive"),
        ({"model": {"id": "m"}, "cache": {"type": "redis"}}, "spec.cache.type", "lru or shm"),
        (
            {"model": {"id": "m"}, "cache": {"type": "shm", "size": "8Gi", "shmSize": "4Gi"}},
            "spec.cache",
            "shmSize (4Gi) must be at least size (8Gi)",
        ),
        (
            {"model": {"id": "m"}, "cache": {"driftThreshold": 1.5}},
            "spec.cache.driftThreshold",
            "[0, 1]",
        ),
        (
            {"model": {"id": "m"}, "telemetry": {"samplingRatio": -0.1}},
            "spec.telemetry.samplingRatio",
            "[0, 1]",
        ),
        ({"model": {"id": "m"}, "ingress": {"enabled": True}}, "spec.ingress", "requires host"),
        ({"model": {"id": "m"}, "engine": "fast"}, "spec.engine", "must be an object"),
        (
            {"model": {"id": "m", "storage": {"claimName": "c"}}},
            "spec.model.storage",
            "claimName needs type PersistentVolumeClaim",
        ),
        (
            {"model": {"id": "m", "storage": {"type": "Disk"}}},
            "spec.model.storage.type",
            "EmptyDir",
        ),
        (
            {"model": {"path": "/m", "tokenSecretRef": {"name": "hf"}}},
            "spec.model.tokenSecretRef",
            "not downloaded",
        ),
        (
            {"model": {"id": "m"}, "rollout": {"maxSurge": 0, "maxUnavailable": "0%"}},
            "spec.rollout",
            "cannot both be 0",
        ),
        ({"model": {"id": "m"}, "rollout": {"maxSurge": "x"}}, "spec.rollout.maxSurge", "25%"),
        (
            {"model": {"id": "m"}, "disruption": {"maxUnavailable": -1}},
            "spec.disruption.maxUnavailable",
            "percentage",
        ),
        (
            {"model": {"id": "m"}, "resources": {"memory": "4Gi"}, "cache": {"size": "4Gi"}},
            "spec.resources.memory",
            "raise resources.memory",
        ),
        (
            {
                "model": {"id": "m"},
                "resources": {"memory": "16Gi", "gpus": 0},
                "engine": {"kvCacheMemory": "12Gi"},
            },
            "spec.resources.memory",
            "CPU KV cache",
        ),
    ],
)
def test_invalid_specs_name_the_field(spec: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        parse_spec(spec)
    assert info.value.field == field
    assert words in str(info.value)


def test_engine_cache_override_decides_the_fit() -> None:
    base = {"model": {"id": "m"}, "resources": {"memory": "8Gi"}, "cache": {"size": "16Gi"}}
    with pytest.raises(InvalidSpecError):
        parse_spec(base)
    ok = parse_spec({**base, "cache": {"size": "16Gi", "engineSize": "2Gi"}})
    assert ok.cache.engine_size_bytes == 2 * 2**30


def test_model_fields() -> None:
    parsed = parse_spec(
        {"model": {"path": "/models/x", "revision": "r1", "processorKwargs": {"size": 336}}}
    )
    assert parsed.model.name == "/models/x"
    assert parsed.model.is_path
    assert parsed.model.served_name == "/models/x"
    assert parsed.model.processor_kwargs == {"size": 336}


def test_storage_rollout_and_disruption_fields() -> None:
    parsed = parse_spec(
        {
            "model": {
                "id": "m",
                "storage": {"type": "PersistentVolumeClaim", "size": "80Gi",
                            "storageClassName": "fast", "accessMode": "ReadWriteMany"},
                "tokenSecretRef": {"name": "hf"},
            },
            "rollout": {"maxSurge": "25%", "maxUnavailable": 0},
            "disruption": {"enabled": False},
        }
    )  # fmt: skip
    storage = parsed.model.storage
    assert storage.create_claim and storage.size_bytes == 80 * 2**30
    assert (storage.storage_class, storage.access_mode) == ("fast", "ReadWriteMany")
    assert parsed.model.token_secret == ("hf", "token")
    assert (parsed.rollout.max_surge, parsed.rollout.max_unavailable) == ("25%", 0)
    assert parsed.disruption.enabled is False
    existing = parse_spec(
        {"model": {"id": "m", "storage": {"type": "PersistentVolumeClaim", "claimName": "c"}}}
    )
    assert not existing.model.storage.create_claim


def test_fault_injection_is_refused_unless_allowed() -> None:
    parsed = parse_spec({"model": {"id": "m"}, "engine": {"faultEvictRate": 0.1}})
    refused = specmod.refused_by_policy(parsed, allow_fault_injection=False)
    assert refused is not None and refused.field == "spec.engine.faultEvictRate"
    assert "--allow-fault-injection" in str(refused)
    assert specmod.refused_by_policy(parsed, allow_fault_injection=True) is None
    plain = parse_spec({"model": {"id": "m"}})
    assert specmod.refused_by_policy(plain, allow_fault_injection=False) is None
