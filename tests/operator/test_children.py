from __future__ import annotations

from typing import Any

import pytest

from mmis_operator import builders
from mmis_operator import kube as r
from mmis_operator.spec import parse_spec


def _containers(dep: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in dep["spec"]["template"]["spec"]["containers"]}


def _args(container: dict[str, Any], flag: str) -> str:
    args = container["args"]
    return args[args.index(flag) + 1]


def test_deployment_has_frontend_and_engine_sharing_shm(sample: dict[str, Any]) -> None:
    dep = builders.deployment(sample, parse_spec(sample["spec"]))
    pods = dep["spec"]["template"]["spec"]
    by_name = _containers(dep)
    assert set(by_name) == {r.FRONTEND, r.ENGINE}
    (shm,) = [v for v in pods["volumes"] if v["name"] == r.SHM_VOLUME]
    assert shm["emptyDir"]["medium"] == "Memory"
    # shmSize 6Gi + 10% headroom (615Mi, rounded up to whole MiB)
    assert shm["emptyDir"]["sizeLimit"] == "6759Mi"
    for container in by_name.values():
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts[r.SHM_MOUNT] == r.SHM_VOLUME
    assert by_name[r.FRONTEND]["args"][0] == "frontend"
    assert by_name[r.ENGINE]["args"][0] == "engine"


def test_frontend_memory_counts_the_shm_volume(sample: dict[str, Any]) -> None:
    dep = builders.deployment(sample, parse_spec(sample["spec"]))
    front = _containers(dep)[r.FRONTEND]["resources"]
    # frontendMemory 4Gi + the 6759Mi volume
    assert front["limits"]["memory"] == "10855Mi"
    assert front["requests"]["memory"] == front["limits"]["memory"]
    assert r.GPU_RESOURCE not in front["limits"]


def test_gpu_limits_only_on_engine(sample: dict[str, Any]) -> None:
    dep = builders.deployment(sample, parse_spec(sample["spec"]))
    engine = _containers(dep)[r.ENGINE]["resources"]
    assert engine["limits"][r.GPU_RESOURCE] == "2"
    assert engine["limits"]["memory"] == "32Gi"
    sample["spec"]["resources"]["gpus"] = 0
    cpu_only = builders.deployment(sample, parse_spec(sample["spec"]))
    assert r.GPU_RESOURCE not in _containers(cpu_only)[r.ENGINE]["resources"]["limits"]
    assert "tolerations" not in cpu_only["spec"]["template"]["spec"]


def test_tensor_parallel_size_follows_the_gpus(sample: dict[str, Any]) -> None:
    dep = builders.deployment(sample, parse_spec(sample["spec"]))
    assert _args(_containers(dep)[r.ENGINE], "--tensor-parallel-size") == "2"
    for gpus in (0, 1):  # one rank: no flag
        sample["spec"]["resources"]["gpus"] = gpus
        single = builders.deployment(sample, parse_spec(sample["spec"]))
        assert "--tensor-parallel-size" not in _containers(single)[r.ENGINE]["args"]


def test_addresses_and_cache_flags_come_from_one_place(sample: dict[str, Any]) -> None:
    dep = builders.deployment(sample, parse_spec(sample["spec"]))
    front, engine = _containers(dep)[r.FRONTEND], _containers(dep)[r.ENGINE]
    for flag in ("--engine-input-address", "--engine-output-address", "--mm-cache-type"):
        assert _args(front, flag) == _args(engine, flag)
    assert _args(front, "--engine-input-address") == r.ENGINE_INPUT_ADDRESS
    assert _args(front, "--mm-cache-gb") == "4"
    assert _args(front, "--port") == str(r.HTTP_PORT)
    assert _args(front, "--ops-port") == str(r.OPS_PORT)
    service = builders.service(sample, parse_spec(sample["spec"]))
    assert [p["name"] for p in service["spec"]["ports"]] == [r.HTTP_PORT_NAME]  # never ops
    assert _args(front, "--shm-gb") == "6"
    assert _args(front, "--shm-dir") == _args(engine, "--shm-dir") == r.SHM_MOUNT


def test_optional_flags(sample: dict[str, Any]) -> None:
    sample["spec"].update(
        cache={"size": "4Gi", "engineSize": "2Gi"},
        engine={"faultEvictRate": 0.25},
        telemetry={"otlpEndpoint": "http://otel:4317"},
        auth={"apiKeySecretRef": {"name": "keys"}},
        allowedLocalMediaPath="/data",
    )
    dep = builders.deployment(sample, parse_spec(sample["spec"]))
    front, engine = _containers(dep)[r.FRONTEND], _containers(dep)[r.ENGINE]
    assert _args(engine, "--engine-mm-cache-gb") == "2"
    assert _args(engine, "--fault-evict-rate") == "0.25"
    assert "--engine-mm-cache-gb" not in front["args"]
    assert _args(front, "--otlp-traces-endpoint") == "http://otel:4317"
    assert "--api-key" not in front["args"]  # a flag would show the key in the pod spec
    (key,) = [e for e in front["env"] if e["name"] == "MMIS_FRONTEND_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "api-key"}
    assert _args(front, "--allowed-local-media-path") == "/data"


def test_probes_and_drain(sample: dict[str, Any]) -> None:
    sample["spec"]["probes"] = {"startupTimeoutSeconds": 1200, "drainSeconds": 20}
    dep = builders.deployment(sample, parse_spec(sample["spec"]))
    front, engine = _containers(dep)[r.FRONTEND], _containers(dep)[r.ENGINE]
    # a probe per container: the front end's liveness is about the front end only
    assert front["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert front["livenessProbe"]["httpGet"]["path"] == "/health"
    startup = front["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] == 1200
    # the engine answers its own probes on its health port (mmis engine --health-port)
    assert _args(engine, "--health-port") == str(r.ENGINE_HEALTH_PORT)
    (port,) = engine["ports"]
    assert (port["name"], port["containerPort"]) == (
        r.ENGINE_HEALTH_PORT_NAME,
        r.ENGINE_HEALTH_PORT,
    )
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine[kind]["httpGet"] == {"path": "/health", "port": r.ENGINE_HEALTH_PORT_NAME}
    engine_startup = engine["startupProbe"]
    assert engine_startup["periodSeconds"] * engine_startup["failureThreshold"] == 1200
    assert front["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "20"]
    assert dep["spec"]["progressDeadlineSeconds"] > 1200


@pytest.mark.parametrize("drain", [0, 20])
def test_termination_in_order(sample: dict[str, Any], drain: int) -> None:
    """The engine gets SIGTERM only after the pod's front ends have exited: P0 holds the drain
    lock while it lives, P1's preStop waits on it for P0's preStop pause + its graceful
    shutdown + 5 s, and the pod's grace period leaves the engine 15 s of its own after that."""
    sample["spec"]["probes"] = {"drainSeconds": drain}
    dep = builders.deployment(sample, parse_spec(sample["spec"]))
    front, engine = _containers(dep)[r.FRONTEND], _containers(dep)[r.ENGINE]
    lock = "/dev/shm/frontend-drain.lock"
    assert _args(front, "--drain-lock") == lock
    wait = drain + 30 + 5
    assert engine["lifecycle"]["preStop"]["exec"]["command"] == [
        "mmis", "wait-frontend", "--lock", lock, "--timeout-s", str(wait),
    ]  # fmt: skip
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == wait + 15
    # the lock is on the volume both containers share
    for container in (front, engine):
        assert {"name": r.SHM_VOLUME, "mountPath": "/dev/shm"} in container["volumeMounts"]
    if drain:  # the front end still pauses first, while endpoints drop the pod
        assert front["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(drain)]
    else:
        assert "lifecycle" not in front


def test_security_context_is_non_root(sample: dict[str, Any]) -> None:
    dep = builders.deployment(sample, parse_spec(sample["spec"]))
    pods = dep["spec"]["template"]["spec"]
    assert pods["securityContext"]["runAsNonRoot"] is True
    assert pods["securityContext"]["runAsUser"] != 0
    for container in pods["containers"]:
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert sc["readOnlyRootFilesystem"] is True


def test_owner_references_and_labels_on_every_child(sample: dict[str, Any]) -> None:
    sample["spec"]["ingress"] = {"enabled": True, "host": "llava.example.com"}
    parsed = parse_spec(sample["spec"])
    objs = [
        builders.deployment(sample, parsed),
        builders.service(sample, parsed),
        builders.ingress(sample, parsed),
    ]
    for obj in objs:
        assert obj is not None
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": "mmis.dev/v1alpha1",
            "kind": "MMInferenceService",
            "name": "llava",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert obj["metadata"]["namespace"] == "ml"
        assert obj["metadata"]["labels"][r.LABEL_SERVICE] == "llava"


def test_service_selects_the_pods(sample: dict[str, Any]) -> None:
    parsed = parse_spec(sample["spec"])
    dep, svc = builders.deployment(sample, parsed), builders.service(sample, parsed)
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert dep["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
    assert svc["spec"]["ports"][0]["targetPort"] == "http"


def test_ingress_only_when_enabled_and_endpoint(sample: dict[str, Any]) -> None:
    parsed = parse_spec(sample["spec"])
    assert builders.ingress(sample, parsed) is None
    assert builders.endpoint(sample, parsed) == "http://llava.ml.svc:8000/v1"
    sample["spec"]["ingress"] = {"enabled": True, "host": "h.example", "tlsSecretName": "tls"}
    parsed = parse_spec(sample["spec"])
    ing = builders.ingress(sample, parsed)
    assert ing is not None
    assert ing["spec"]["tls"] == [{"hosts": ["h.example"], "secretName": "tls"}]
    assert builders.endpoint(sample, parsed) == "https://h.example/v1"


def test_pod_template_override_merges_but_keeps_the_selector(sample: dict[str, Any]) -> None:
    sample["spec"]["podTemplate"] = {
        "metadata": {"labels": {"team": "vision", r.LABEL_INSTANCE: "hijack"}},
        "spec": {
            "containers": [
                {"name": "engine", "env": [{"name": "EXTRA", "value": "1"}]},
                {"name": "sidecar", "image": "busybox"},
            ],
            "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "m"}}],
        },
    }
    dep = builders.deployment(sample, parse_spec(sample["spec"]))
    template = dep["spec"]["template"]
    assert template["metadata"]["labels"]["team"] == "vision"
    assert template["metadata"]["labels"][r.LABEL_INSTANCE] == "llava"
    by_name = _containers(dep)
    assert list(by_name) == ["frontend", "engine", "sidecar"]
    env = {e["name"] for e in by_name["engine"]["env"]}
    assert {"EXTRA", "HF_HOME"} <= env
    assert {v["name"] for v in template["spec"]["volumes"]} >= {"dshm", "models"}


def test_builders_are_deterministic(sample: dict[str, Any]) -> None:
    parsed = parse_spec(sample["spec"])
    assert builders.deployment(sample, parsed) == builders.deployment(sample, parsed)
    assert builders.address_args() == builders.address_args()


def test_owner_without_uid_is_refused(sample: dict[str, Any]) -> None:
    del sample["metadata"]["uid"]
    with pytest.raises(builders.OwnerError, match="uid"):
        builders.deployment(sample, parse_spec(sample["spec"]))


def test_model_cache_defaults_to_a_sized_empty_dir(sample: dict[str, Any]) -> None:
    dep = builders.deployment(sample, parse_spec(sample["spec"]))
    pods = dep["spec"]["template"]["spec"]
    (cache,) = [v for v in pods["volumes"] if v["name"] == builders.MODEL_CACHE_VOLUME]
    assert cache == {"name": "model-cache", "emptyDir": {"sizeLimit": "50Gi"}}
    engine = _containers(dep)[r.ENGINE]
    assert engine["resources"]["requests"]["ephemeral-storage"] == "50Gi"
    assert builders.model_claim(sample, parse_spec(sample["spec"])) is None


def test_one_download_per_pod_shared_by_both_containers(sample: dict[str, Any]) -> None:
    sample["spec"]["model"].update(revision="r1", tokenSecretRef={"name": "hf"})
    dep = builders.deployment(sample, parse_spec(sample["spec"]))
    pods = dep["spec"]["template"]["spec"]
    (init,) = pods["initContainers"]
    assert init["name"] == builders.DOWNLOAD
    assert init["args"] == ["llava-hf/llava-1.5-7b-hf", "r1"]
    (token,) = [e for e in init["env"] if e["name"] == "HF_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    assert init["securityContext"]["allowPrivilegeEscalation"] is False
    home = {e["name"]: e.get("value") for e in init["env"]}["HF_HOME"]
    for container in _containers(dep).values():
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["HF_HOME"] == home and env["HF_HUB_OFFLINE"] == "1"
        assert "HF_TOKEN" not in env  # only the download gets the token
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts[builders.MODEL_CACHE_VOLUME] == builders.CACHE_DIR
    sample["spec"]["model"] = {"path": "/models/x"}
    local = builders.deployment(sample, parse_spec(sample["spec"]))
    assert "initContainers" not in local["spec"]["template"]["spec"]


def test_model_cache_on_a_claim(sample: dict[str, Any]) -> None:
    sample["spec"]["model"]["storage"] = {
        "type": "PersistentVolumeClaim", "size": "100Gi", "storageClassName": "fast",
    }  # fmt: skip
    parsed = parse_spec(sample["spec"])
    claim = builders.model_claim(sample, parsed)
    assert claim is not None
    assert claim["metadata"]["name"] == "llava-model-cache"
    assert claim["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert claim["spec"]["resources"]["requests"]["storage"] == "100Gi"
    assert claim["spec"]["storageClassName"] == "fast"
    dep = builders.deployment(sample, parsed)
    (cache,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "model-cache"]
    assert cache["persistentVolumeClaim"] == {"claimName": "llava-model-cache"}
    assert "ephemeral-storage" not in _containers(dep)[r.ENGINE]["resources"]["requests"]
    sample["spec"]["model"]["storage"] = {"type": "PersistentVolumeClaim", "claimName": "mine"}
    existing = parse_spec(sample["spec"])
    assert builders.model_claim(sample, existing) is None
    dep = builders.deployment(sample, existing)
    (cache,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "model-cache"]
    assert cache["persistentVolumeClaim"] == {"claimName": "mine"}


def test_pod_template_volume_replaces_the_model_cache(sample: dict[str, Any]) -> None:
    pvc = {"name": "model-cache", "persistentVolumeClaim": {"claimName": "shared"}}
    sample["spec"]["podTemplate"] = {"spec": {"volumes": [pvc]}}
    dep = builders.deployment(sample, parse_spec(sample["spec"]))
    (cache,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "model-cache"]
    assert cache == pvc


def test_rollout_defaults_never_wait_for_a_spare_gpu(sample: dict[str, Any]) -> None:
    dep = builders.deployment(sample, parse_spec(sample["spec"]))
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    sample["spec"]["rollout"] = {"maxSurge": 1, "maxUnavailable": 0}
    dep = builders.deployment(sample, parse_spec(sample["spec"]))
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_disruption_budget(sample: dict[str, Any]) -> None:
    parsed = parse_spec(sample["spec"])
    pdb = builders.disruption_budget(sample, parsed)
    assert pdb is not None
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == r.selector_labels("llava")
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    sample["spec"]["disruption"] = {"enabled": False}
    assert builders.disruption_budget(sample, parse_spec(sample["spec"])) is None


def test_ingress_routes_only_the_api_and_health(sample: dict[str, Any]) -> None:
    sample["spec"]["ingress"] = {"enabled": True, "host": "h.example", "path": "/llava/"}
    ing = builders.ingress(sample, parse_spec(sample["spec"]))
    assert ing is not None
    paths = [p["path"] for p in ing["spec"]["rules"][0]["http"]["paths"]]
    assert paths == ["/llava/v1", "/llava/health"]
    sample["spec"]["ingress"] = {"enabled": True, "host": "h.example"}
    ing = builders.ingress(sample, parse_spec(sample["spec"]))
    assert ing is not None
    assert [p["path"] for p in ing["spec"]["rules"][0]["http"]["paths"]] == ["/v1", "/health"]


def test_inference_pods_get_no_token_and_the_front_end_no_gpu(sample: dict[str, Any]) -> None:
    dep = builders.deployment(sample, parse_spec(sample["spec"]))
    assert dep["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    env = {e["name"]: e.get("value") for e in _containers(dep)[r.FRONTEND]["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    engine_env = {e["name"] for e in _containers(dep)[r.ENGINE]["env"]}
    assert "NVIDIA_VISIBLE_DEVICES" not in engine_env  # the device plugin sets the engine's
