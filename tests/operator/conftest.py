"""Shared sample resources for the operator's unit tests (no cluster)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

SAMPLE: dict[str, Any] = {
    "apiVersion": "mmis.dev/v1alpha1",
    "kind": "MMInferenceService",
    "metadata": {"name": "llava", "namespace": "ml", "uid": "uid-1", "generation": 3},
    "spec": {
        "model": {"id": "llava-hf/llava-1.5-7b-hf"},
        "replicas": 2,
        "resources": {"gpus": 2, "memory": "32Gi"},
        "cache": {"type": "shm", "size": "4Gi", "shmSize": "6Gi"},
    },
}


@pytest.fixture
def sample() -> dict[str, Any]:
    return copy.deepcopy(SAMPLE)
