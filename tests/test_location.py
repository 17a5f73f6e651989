"""One parser of checkpoint locations (storage.location) and Storage.sibling."""

from __future__ import annotations

import os

import numpy as np
import pytest

import snapshard
from snapshard.storage import LocalStorage, parse_location, storage_for
from snapshard.storage.location import require_supported


@pytest.mark.parametrize(
    ("text", "scheme", "bucket", "path", "local"),
    [
        ("run/step_1", "", "", "run/step_1", "run/step_1"),
        ("/abs/run", "", "", "/abs/run", "/abs/run"),
        ("file:///abs/run", "file", "", "/abs/run", "/abs/run"),
        ("s3://bucket/run/step_1/", "s3", "bucket", "run/step_1", None),
        ("gs://bucket", "gs", "bucket", "", None),
        ("memory:///x/y", "memory", "", "x/y", None),
    ],
)
def test_parts(text, scheme, bucket, path, local):
    loc = parse_location(text)
    assert (loc.text, loc.scheme, loc.bucket, loc.path, loc.local_path) == (
        text, scheme, bucket, path, local,
    )  # fmt: skip
    assert loc.is_local == (local is not None)
    assert loc.is_object_store == (local is None)


def test_parent_name_and_sibling(tmp_path):
    assert parse_location("s3://b/run/step_9/").parent_and_name() == ("s3://b/run", "step_9")
    assert parse_location("s3://b/run/step_9").sibling("step_8") == "s3://b/run/step_8"
    here = tmp_path / "run" / "step_9"
    assert parse_location(here).parent_and_name() == (str(tmp_path / "run"), "step_9")
    rel = parse_location("step_9")
    assert rel.parent_and_name() == (os.getcwd(), "step_9")


def test_unsupported_scheme_is_refused_by_name():
    with pytest.raises(ValueError, match=r"unsupported checkpoint location 'ftp://h/x'.*'ftp'"):
        require_supported(parse_location("ftp://h/x"))
    with pytest.raises(ValueError, match="unsupported checkpoint location"):
        storage_for("ftp://h/x")


def test_local_sibling_reads_the_checkpoint_beside(tmp_path):
    snapshard.save(tmp_path / "a", {"x": np.arange(4)})
    sib = LocalStorage(tmp_path / "b").sibling("a")
    assert isinstance(sib, LocalStorage) and sib.referenced
    assert sib.is_committed()
    os.symlink(tmp_path / "a", tmp_path / "link")
    linked = LocalStorage(tmp_path / "b").sibling("link")
    with pytest.raises(snapshard.CorruptCheckpointError, match="symbolic link"):
        linked.read_manifest()


def test_object_store_sibling_shares_the_store():
    pytest.importorskip("obstore")
    from snapshard.storage.objstore import ObjectStorage

    snapshard.save("memory://sib-bucket/run/a", {"x": np.arange(4)})
    here = ObjectStorage("memory://sib-bucket/run/b")
    sib = here.sibling("a")
    assert isinstance(sib, ObjectStorage)
    assert sib.is_committed()
    assert not here.sibling("c").is_committed()
