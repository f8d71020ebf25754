"""Atomic publication (AFN-003, AFN-010): a failure before the commit point
leaves the old target byte-identical and no sibling temp behind.

All cases are contract controls: synthetic bytes and injected faults."""

import os

import pytest

from hebrus_mlx.artifact.atomic import Faults, State, publish_dir, publish_file
from hebrus_mlx.artifact.errors import PublishError

OLD, NEW = b"old-content" * 100, b"new-content" * 5000


def _dir_listing(d):
    return sorted(os.listdir(d))


@pytest.fixture
def target(tmp_path):
    p = tmp_path / "store.bin"
    p.write_bytes(OLD)
    return p


def test_publish_walks_every_state_in_order(target):
    """AFN-003: temp, write, fsync, verify, dir fsync, rename, dir fsync."""
    seen = []
    trace = publish_file(target, lambda w: w.write(NEW), verify=lambda tmp: seen.append(open(tmp, "rb").read()))
    assert trace == [
        State.INIT,
        State.TEMP,
        State.WRITTEN,
        State.SYNCED,
        State.VERIFIED,
        State.DIR_SYNCED,
        State.RENAMED,
        State.COMMITTED,
    ]
    assert seen == [NEW] and target.read_bytes() == NEW
    assert _dir_listing(target.parent) == ["store.bin"]


@pytest.mark.parametrize("fault", ["fsync", "short_write", "enospc", "rename"])
def test_injected_failure_keeps_old_target_and_no_temp(target, fault):
    """AFN-003: each injected failure aborts before the commit point."""
    with pytest.raises(PublishError) as e:
        publish_file(target, lambda w: w.write(NEW), faults=Faults(**{fault: True}))
    assert not e.value.committed
    assert target.read_bytes() == OLD
    assert _dir_listing(target.parent) == ["store.bin"]


def test_verify_failure_through_reader_aborts(target):
    """AFN-003: the reopened temp must pass the reader before rename."""

    def verify(tmp):
        raise PublishError("store", "reader rejected")

    with pytest.raises(PublishError):
        publish_file(target, lambda w: w.write(NEW), verify=verify)
    assert target.read_bytes() == OLD and _dir_listing(target.parent) == ["store.bin"]


def test_post_rename_dir_fsync_failure_is_reported_not_rolled_back(target):
    """AFN-003: after the commit point the new file stays; the error says committed."""
    with pytest.raises(PublishError) as e:
        publish_file(target, lambda w: w.write(NEW), faults=Faults(dir_fsync_after=True))
    assert e.value.committed and target.read_bytes() == NEW


def test_short_write_really_short(tmp_path):
    """Contract control: a persistent short write is an error, never a truncated file."""
    p = tmp_path / "new.bin"
    with pytest.raises(PublishError):
        publish_file(p, lambda w: w.write(NEW), faults=Faults(short_write=True))
    assert not p.exists() and _dir_listing(tmp_path) == []


def _build(files):
    def build(tmp):
        for name, data in files.items():
            publish_file(os.path.join(tmp, name), lambda w, data=data: w.write(data))

    return build


def test_directory_exchange_replaces_whole_tree(tmp_path):
    """AFN-010: a directory is swapped in whole; the old tree is removed after commit."""
    d = tmp_path / "artifact"
    publish_dir(d, _build({"a": b"1", "b": b"2"}))
    publish_dir(d, _build({"c": b"3"}))
    assert _dir_listing(d) == ["c"] and _dir_listing(tmp_path) == ["artifact"]


@pytest.mark.parametrize("fault", ["fsync", "rename"])
def test_directory_failure_keeps_old_tree(tmp_path, fault):
    """AFN-010: failing directory publication leaves the previous tree intact."""
    d = tmp_path / "artifact"
    publish_dir(d, _build({"a": b"1"}))
    with pytest.raises(PublishError):
        publish_dir(d, _build({"z": b"9"}), faults=Faults(**{fault: True}))
    assert _dir_listing(d) == ["a"] and (d / "a").read_bytes() == b"1"
    assert _dir_listing(tmp_path) == ["artifact"]


def test_directory_verify_failure_keeps_old_tree(tmp_path):
    d = tmp_path / "artifact"
    publish_dir(d, _build({"a": b"1"}))

    def verify(tmp):
        raise PublishError("artifact", "admission rejected")

    with pytest.raises(PublishError):
        publish_dir(d, _build({"z": b"9"}), verify=verify)
    assert _dir_listing(d) == ["a"] and _dir_listing(tmp_path) == ["artifact"]
