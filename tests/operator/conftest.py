"""Shared sample resource, resource store and in-memory API for the operator's unit tests
(no cluster)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from mmis_operator.kube import KubeError, object_path

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


class FakeStore:
    """The API server's copy of one resource: a resourceVersion, 409 for a stale status write.

    ``rival`` is another writer's change to the stored status; it wins the race before each of
    our next ``conflicts`` writes, so those fail with 409 as on the real API server. Events are
    recorded as ``(type, reason)``. The real paths are covered in tests/kube/.
    """

    def __init__(self, obj: dict[str, Any], rival: Any = None, conflicts: int = 0) -> None:
        self.obj = obj
        self.obj["metadata"]["resourceVersion"] = "1"
        self.rival, self.conflicts = rival, conflicts
        self.tries = self.writes = 0  # status PUTs attempted / stored
        self.events: list[tuple[str, str]] = []
        self.pods: list[dict[str, Any]] = []  # what a pod LIST returns
        self.lists = 0

    def get(self, path: str) -> dict[str, Any] | None:
        own = path.endswith(f"/mminferenceservices/{self.obj['metadata']['name']}")
        return copy.deepcopy(self.obj) if own else None

    def replace_status(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.tries += 1
        if self.conflicts:
            self.conflicts -= 1
            self.rival(self.obj.setdefault("status", {}))
            self._bump()
        if obj["metadata"]["resourceVersion"] != self.obj["metadata"]["resourceVersion"]:
            raise KubeError(409, "the object has been modified", "Conflict")
        self.writes += 1
        self.obj["status"] = copy.deepcopy(obj["status"])
        self._bump()
        return copy.deepcopy(self.obj)

    def _bump(self) -> None:
        meta = self.obj["metadata"]
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)

    def list(self, path: str, label_selector: str) -> list[dict[str, Any]]:
        self.lists += 1
        return copy.deepcopy(self.pods)

    def post_event(self, involved: Any, kind: str, reason: str, message: str) -> None:
        self.events.append((kind, reason))


@pytest.fixture
def store(sample: dict[str, Any]) -> FakeStore:
    """The sample resource in a :class:`FakeStore` (set ``rival``/``conflicts`` for races)."""
    return FakeStore(sample)


class FakeKube(FakeStore):
    """The resource and its children: apply stores, get reads, delete removes (by path)."""

    def __init__(self, obj: dict[str, Any]) -> None:
        super().__init__(obj)
        self.children: dict[str, dict[str, Any]] = {}
        self.gets: list[str] = []
        self.deleted: list[str] = []
        self.created: list[str] = []  # create() calls (POST), stored or 409

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        meta = manifest["metadata"]
        path = object_path(
            manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"]
        )
        stored = copy.deepcopy(manifest)
        if manifest["kind"] == "Deployment":
            stored["metadata"]["generation"] = 1
        self.children[path] = stored
        return copy.deepcopy(stored)

    def create(self, manifest: dict[str, Any]) -> bool:
        """POST: stores a new object; an existing one is left as it is (409 -> False)."""
        meta = manifest["metadata"]
        path = object_path(
            manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"]
        )
        self.created.append(path)
        if path in self.children:
            return False
        self.children[path] = copy.deepcopy(manifest)
        return True

    def get(self, path: str) -> dict[str, Any] | None:
        self.gets.append(path)
        if path in self.children:
            return copy.deepcopy(self.children[path])
        return super().get(path)

    def delete(self, path: str) -> None:
        self.deleted.append(path)
        self.children.pop(path, None)

    def kinds(self) -> set[str]:
        return {c["kind"] for c in self.children.values()}


@pytest.fixture
def kube_factory() -> type[FakeKube]:
    """:class:`FakeKube`, for tests that build one from their own resource."""
    return FakeKube
