"""file:// URLs: only below the allowed root, after resolving ``..`` and symlinks."""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path

import pytest

from mmis.frontend.client.media.local import LocalMediaReader
from mmis.frontend.errors import InvalidMediaError, MediaForbiddenError, MediaTooLargeError

CONTENT = b"\x89PNG not really, but bytes are bytes"


def file_url(path: Path | str) -> str:
    return "file://" + urllib.parse.quote(str(path))


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """``root/`` holding ``cat.png`` and ``sub/dog.png``; ``outside/secret.png`` next to it."""
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "cat.png").write_bytes(CONTENT)
    (root / "sub" / "dog.png").write_bytes(CONTENT)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.png").write_bytes(b"secret")
    return root, outside


def test_reads_files_below_the_root(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    reader = LocalMediaReader(str(root), max_bytes=1000)
    assert reader.read(file_url(root / "cat.png")) == CONTENT
    assert reader.read(file_url(root / "sub" / "dog.png")) == CONTENT
    assert reader.read(f"file://localhost{root}/sub/../cat.png") == CONTENT


def test_disabled_without_a_root(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    with pytest.raises(MediaForbiddenError, match="--allowed-local-media-path") as info:
        LocalMediaReader(None, max_bytes=1000).read(file_url(root / "cat.png"))
    assert info.value.status == 403


def test_dotdot_escape_is_refused(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    url = f"file://{root}/../outside/secret.png"
    with pytest.raises(MediaForbiddenError, match="outside the allowed media root") as info:
        LocalMediaReader(str(root), max_bytes=1000).read(url, param="messages[0].content[0]")
    assert info.value.status == 403
    assert info.value.param == "messages[0].content[0]"


def test_percent_encoded_dotdot_is_refused(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    url = f"file://{root}/%2e%2e/outside/secret.png"
    with pytest.raises(MediaForbiddenError):
        LocalMediaReader(str(root), max_bytes=1000).read(url)


def test_absolute_path_outside_is_refused(tree: tuple[Path, Path]) -> None:
    root, outside = tree
    with pytest.raises(MediaForbiddenError):
        LocalMediaReader(str(root), max_bytes=1000).read(file_url(outside / "secret.png"))


def test_symlink_escaping_the_root_is_refused(tree: tuple[Path, Path]) -> None:
    root, outside = tree
    (root / "link.png").symlink_to(outside / "secret.png")
    (root / "linkdir").symlink_to(outside, target_is_directory=True)
    reader = LocalMediaReader(str(root), max_bytes=1000)
    with pytest.raises(MediaForbiddenError, match="outside"):
        reader.read(file_url(root / "link.png"))
    with pytest.raises(MediaForbiddenError, match="outside"):
        reader.read(file_url(root / "linkdir" / "secret.png"))


def test_symlink_staying_inside_the_root_is_allowed(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    (root / "alias.png").symlink_to(root / "sub" / "dog.png")
    assert LocalMediaReader(str(root), max_bytes=1000).read(file_url(root / "alias.png")) == (
        CONTENT
    )


def test_root_given_through_a_symlink_still_works(tree: tuple[Path, Path], tmp_path: Path) -> None:
    root, _ = tree
    (tmp_path / "root-link").symlink_to(root, target_is_directory=True)
    reader = LocalMediaReader(str(tmp_path / "root-link"), max_bytes=1000)
    assert reader.read(file_url(tmp_path / "root-link" / "cat.png")) == CONTENT


def test_sibling_with_common_prefix_is_outside(tree: tuple[Path, Path], tmp_path: Path) -> None:
    root, _ = tree
    evil = tmp_path / "root-evil"
    evil.mkdir()
    (evil / "x.png").write_bytes(b"x")
    with pytest.raises(MediaForbiddenError):
        LocalMediaReader(str(root), max_bytes=1000).read(file_url(evil / "x.png"))


def test_missing_file_is_a_400(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    with pytest.raises(InvalidMediaError, match="not found"):
        LocalMediaReader(str(root), max_bytes=1000).read(file_url(root / "nope.png"))


def test_fifo_is_refused_without_blocking(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    os.mkfifo(root / "pipe.png")
    with pytest.raises(InvalidMediaError, match="not a regular file"):
        LocalMediaReader(str(root), max_bytes=1000).read(file_url(root / "pipe.png"))


def test_directory_is_refused(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    with pytest.raises(InvalidMediaError, match="not a regular file"):
        LocalMediaReader(str(root), max_bytes=1000).read(file_url(root / "sub"))


def test_oversize_file_is_refused(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    with pytest.raises(MediaTooLargeError, match=f"limit of {len(CONTENT) - 1} bytes"):
        LocalMediaReader(str(root), max_bytes=len(CONTENT) - 1).read(file_url(root / "cat.png"))


@pytest.mark.parametrize(
    ("url", "match"),
    [("file://example.com/etc/passwd", "remote host"), ("file:relative.png", "absolute path")],
)
def test_malformed_file_urls(tree: tuple[Path, Path], url: str, match: str) -> None:
    root, _ = tree
    with pytest.raises(InvalidMediaError, match=match):
        LocalMediaReader(str(root), max_bytes=1000).read(url)
