from __future__ import annotations

import pytest

from mmis_operator.spec import OverrideError, merge


def test_named_lists_merge_by_name_and_others_replace() -> None:
    base = {
        "containers": [{"name": "a", "args": ["x"], "env": [{"name": "E", "value": "1"}]}],
        "tolerations": [{"key": "k1"}],
    }
    out = merge(
        base,
        {
            "containers": [{"name": "a", "args": ["y"], "env": [{"name": "F", "value": "2"}]}],
            "tolerations": [{"key": "k2"}],
        },
    )
    (a,) = out["containers"]
    assert a["args"] == ["y"]
    assert [e["name"] for e in a["env"]] == ["E", "F"]
    assert out["tolerations"] == [{"key": "k2"}]


def test_inputs_are_not_mutated() -> None:
    base = {"spec": {"containers": [{"name": "a"}]}}
    override = {"spec": {"containers": [{"name": "b"}]}}
    out = merge(base, override)
    out["spec"]["containers"][1]["image"] = "changed"
    assert base == {"spec": {"containers": [{"name": "a"}]}}
    assert override == {"spec": {"containers": [{"name": "b"}]}}


def test_named_entry_without_name_is_an_error() -> None:
    with pytest.raises(OverrideError, match=r"spec\.volumes: every entry needs a name"):
        merge({"spec": {"volumes": []}}, {"spec": {"volumes": [{"emptyDir": {}}]}})


def test_a_volume_of_the_same_name_replaces_ours_whole() -> None:
    base = {"volumes": [{"name": "model-cache", "emptyDir": {"sizeLimit": "50Gi"}}]}
    pvc = {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models"}}
    out = merge(base, {"volumes": [pvc]})
    assert out["volumes"] == [pvc]  # one source: the API server rejects two
