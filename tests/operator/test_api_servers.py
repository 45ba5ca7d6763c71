"""``spec.frontend.apiServers`` (issue 45 item 1, the operator's side): N P0 processes in the
front-end container, ``--api-servers N``, the container's requests scaled by one rule
(``spec.parse_frontend``), and nothing else of the pod changed.

- Unset (and with today's default CPU request) the children are byte for byte
  golden/children_without_routing.json (test_routing.py checks those cases; here the same
  cases with ``apiServers: 1`` or the old defaults written out give the same bytes).
- ``apiServers: 4`` and the CPU-derived default: byte for byte golden/children_api_servers.json,
  and against the one-process pod only the flag and the P0 container's requests differ (probes,
  ports, the /dev/shm volume, the grace period and the engine are the same).

The real API server's bounds are tested in tests/kube/test_crd_apiservers_mmis.py, a pod with
two processes on a real node in tests/kube/test_realnode_apiservers.py.

Regenerate the golden file (only for an intended change; review the diff and say in the commit
what changed): ``.venv/bin/python tests/operator/test_api_servers.py --write-golden NOTE``.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from mmis_operator import builders
from mmis_operator import kube as r
from mmis_operator import spec as specmod
from mmis_operator.spec import InvalidSpecError, parse_spec

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
GOLDEN = GOLDEN_DIR / "children_api_servers.json"
BEFORE = json.loads((GOLDEN_DIR / "children_without_routing.json").read_text())["cases"]
CASES: dict[str, dict[str, Any]] = json.loads(GOLDEN.read_text())["cases"]
GI = 2**30


def _bytes(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode()


def _with(resource: dict[str, Any], **sections: dict[str, Any]) -> dict[str, Any]:
    """``resource`` with each named spec section updated (merged one level deep)."""
    obj = copy.deepcopy(resource)
    for key, value in sections.items():
        obj["spec"][key] = {**obj["spec"].get(key, {}), **value}
    return obj


def _deployment(resource: dict[str, Any]) -> dict[str, Any]:
    return builders.deployment(resource, parse_spec(resource["spec"]))


def _front(dep: dict[str, Any]) -> dict[str, Any]:
    (front,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == r.FRONTEND]
    return front


def write_golden(note: str) -> None:
    """Rewrite the golden children from today's builders (same resources), ``note`` appended."""
    data = json.loads(GOLDEN.read_text())
    for case in data["cases"].values():
        spec = parse_spec(case["resource"]["spec"])
        case["deployment"] = builders.deployment(case["resource"], spec)
        case["service"] = builders.service(case["resource"], spec)
    data["_note"] = f"{data['_note']} {note}".strip()
    GOLDEN.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("case", sorted(BEFORE))
@pytest.mark.parametrize(
    "written",
    [
        {"frontend": {}},
        {"frontend": {"apiServers": 1}},
        # a resource stored while the CRD still defaulted them holds these values as written
        {"resources": {"frontendCpu": "2", "frontendMemory": "4Gi"}},
    ],
    ids=["empty-section", "one-process", "old-crd-defaults"],
)
def test_one_process_written_out_is_byte_for_byte_today(
    case: str, written: dict[str, dict[str, Any]]
) -> None:
    golden = BEFORE[case]
    resources = golden["resource"]["spec"].get("resources", {})
    # what the case writes itself stays (the old CRD defaulted only what was unset)
    written = {k: {**v, **resources} if k == "resources" else v for k, v in written.items()}
    body = _with(golden["resource"], **written)
    spec = parse_spec(body["spec"])
    assert spec.api_servers == 1
    assert _bytes(builders.deployment(body, spec)) == _bytes(golden["deployment"])
    assert _bytes(builders.service(body, spec)) == _bytes(golden["service"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_children_are_byte_identical_to_the_golden_file(case: str) -> None:
    body = CASES[case]["resource"]
    spec = parse_spec(body["spec"])
    assert _bytes(builders.deployment(body, spec)) == _bytes(CASES[case]["deployment"])
    assert _bytes(builders.service(body, spec)) == _bytes(CASES[case]["service"])


def test_golden_cases_are_what_they_say() -> None:
    four = parse_spec(CASES["api-servers-4"]["resource"]["spec"])
    derived = parse_spec(CASES["derived-from-cpu"]["resource"]["spec"])
    explicit = parse_spec(CASES["api-servers-4-explicit-requests"]["resource"]["spec"])
    assert (four.api_servers, four.frontend_cpu, four.frontend_memory_bytes) == (4, "8", 16 * GI)
    assert (derived.api_servers, derived.frontend_cpu) == (4, "8")
    assert derived.frontend_memory_bytes == 16 * GI
    assert (explicit.api_servers, explicit.frontend_cpu) == (4, "3")
    assert explicit.frontend_memory_bytes == 6 * GI


def test_four_processes_change_only_the_flag_and_the_requests(sample: dict[str, Any]) -> None:
    """Against the one-process pod (the sample: shm cache, 2 GPUs): ``--api-servers 4`` right
    after ``--drain-lock``, CPU 4 x 2 and memory 4 x 4Gi plus the same /dev/shm volume, and the
    engine's wait for the drain (so the grace period) longer by the supervisor's margin; the
    probes, ports, volumes, the rest of the engine and ``--shm-gb`` are those of one process."""
    one = _deployment(sample)
    four = _deployment(_with(sample, frontend={"apiServers": 4}))
    front = _front(four)
    args = front["args"]
    lock = args.index("--drain-lock")
    assert args[lock + 2 : lock + 4] == ["--api-servers", "4"]
    assert args.count("--api-servers") == 1
    assert args[args.index("--shm-gb") + 1] == "6"  # the total of all four, not per process
    shm = 6759 * 2**20  # shmSize 6Gi + 10% headroom, as for one process
    memory = builders.format_bytes(4 * 4 * GI + shm)
    assert front["resources"] == {
        "requests": {"cpu": "8", "memory": memory},
        "limits": {"memory": memory},
    }
    # the drain: the engine waits for the last child, which the supervisor kills at the
    # latest graceful shutdown + its margin after SIGTERM; the grace period covers that wait
    pod = four["spec"]["template"]["spec"]
    engine = pod["containers"][1]
    hook = engine["lifecycle"]["preStop"]["exec"]["command"]
    wait = builders.FRONTEND_GRACEFUL_SECONDS + builders.API_SERVERS_STOP_MARGIN_SECONDS
    assert hook[-2:] == ["--timeout-s", str(15 + wait + 5)]  # drainSeconds 15 (default)
    assert pod["terminationGracePeriodSeconds"] == 15 + wait + 5 + builders.ENGINE_STOP_SECONDS
    # take exactly those away and what is left is the one-process pod
    del args[lock + 2 : lock + 4]
    front["resources"] = _front(one)["resources"]
    one_pod = one["spec"]["template"]["spec"]
    hook[-1] = one_pod["containers"][1]["lifecycle"]["preStop"]["exec"]["command"][-1]
    pod["terminationGracePeriodSeconds"] = one_pod["terminationGracePeriodSeconds"]
    assert _bytes(four) == _bytes(one)


def test_explicit_requests_are_taken_exactly(sample: dict[str, Any]) -> None:
    """Both requests written: the container gets exactly them (plus the /dev/shm volume, as
    for one process), whatever apiServers is; one written: only the other is scaled."""
    exact = _with(sample, frontend={"apiServers": 4})
    exact["spec"]["resources"].update(frontendCpu="3", frontendMemory="6Gi")
    requests = _front(_deployment(exact))["resources"]["requests"]
    assert requests == {"cpu": "3", "memory": builders.format_bytes(6 * GI + 6759 * 2**20)}
    cpu_only = _with(sample, frontend={"apiServers": 3})
    cpu_only["spec"]["resources"]["frontendCpu"] = "1500m"
    spec = parse_spec(cpu_only["spec"])
    assert (spec.frontend_cpu, spec.frontend_memory_bytes) == ("1500m", 3 * 4 * GI)
    memory_only = _with(sample, frontend={"apiServers": 3})
    memory_only["spec"]["resources"]["frontendMemory"] = "5Gi"
    spec = parse_spec(memory_only["spec"])
    assert (spec.frontend_cpu, spec.frontend_memory_bytes) == ("6", 5 * GI)


@pytest.mark.parametrize(
    ("cpu", "processes"),
    [
        ("250m", 1),
        ("2", 1),
        ("3", 1),
        ("3999m", 1),
        ("4", 2),
        ("4.5", 2),
        ("8", 4),
        ("16", 8),
        ("17", 8),
        ("64", 8),
    ],
)
def test_the_default_is_one_process_per_two_cpus_up_to_eight(cpu: str, processes: int) -> None:
    spec = parse_spec({"model": {"id": "m"}, "resources": {"frontendCpu": cpu}})
    assert spec.api_servers == processes
    assert specmod.derived_api_servers(specmod.parse(cpu, "cpu")) == processes
    assert spec.frontend_cpu == cpu  # written: exactly
    assert spec.frontend_memory_bytes == processes * 4 * GI  # unset: one process's, times N
    args = _front(builders.deployment(
        {"metadata": {"name": "x", "namespace": "n", "uid": "u"}, "spec": {}}, spec
    ))["args"]  # fmt: skip
    if processes == 1:
        assert "--api-servers" not in args
    else:
        assert args[args.index("--api-servers") + 1] == str(processes)


def test_an_explicit_count_beats_the_derived_one() -> None:
    spec = parse_spec(
        {"model": {"id": "m"}, "frontend": {"apiServers": 1}, "resources": {"frontendCpu": "16"}}
    )
    assert (spec.api_servers, spec.frontend_cpu, spec.frontend_memory_bytes) == (1, "16", 4 * GI)
    most = parse_spec({"model": {"id": "m"}, "frontend": {"apiServers": 64}})
    assert (most.api_servers, most.frontend_cpu, most.frontend_memory_bytes) == (
        64,
        "128",
        256 * GI,
    )


@pytest.mark.parametrize("value", [0, 65, -1, "2", True, 2.5, None])
def test_out_of_range_or_not_a_whole_number_is_refused(value: Any) -> None:
    spec: dict[str, Any] = {"model": {"id": "m"}, "frontend": {"apiServers": value}}
    if value is None:  # null is unset
        assert parse_spec(spec).api_servers == 1
        return
    with pytest.raises(InvalidSpecError) as info:
        parse_spec(spec)
    assert info.value.field == "spec.frontend.apiServers"
    assert "[1, 64]" in str(info.value)


def test_a_frontend_section_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(InvalidSpecError) as info:
        parse_spec({"model": {"id": "m"}, "frontend": 4})
    assert info.value.field == "spec.frontend"


if __name__ == "__main__":  # pragma: no cover
    if len(sys.argv) != 3 or sys.argv[1] != "--write-golden":
        sys.exit("usage: test_api_servers.py --write-golden NOTE")
    write_golden(sys.argv[2])
