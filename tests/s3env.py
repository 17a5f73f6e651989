"""The local object-store test servers (S3: radosgw; GCS: fake-gcs-server; Azure: Azurite).

.ci/run starts each (../shared/objstore/) and exports its settings; the tests of a store
whose server is not configured are skipped:

- S3: AWS_ENDPOINT_URL, the credentials and AWS_ALLOW_HTTP; a bucket is made per session
  (obstore cannot create buckets: a presigned PUT of the bucket itself).
- GCS: STORAGE_EMULATOR_HOST; the emulator's bucket (GCS_BUCKETS, default "ckpt").
- Azure: AZURITE_BLOB_STORAGE_URL with AZURE_STORAGE_USE_EMULATOR=true; the emulator's
  container (AZURE_CONTAINERS, default "ckpt").

Tests use `store_params()` (marks `s3`, `gcs`, `azure`) with `bucket_url`, or the
`remote_prefix` fixture: a fresh prefix on each configured store.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest

ENDPOINT_VAR = "AWS_ENDPOINT_URL"  # the S3 server, for tests that talk to it directly


@dataclass(frozen=True)
class TestServer:
    """One store's local server: the variable that says it runs, and its bucket fixture."""

    scheme: str
    marker: str
    env: str
    fixture: str

    @property
    def skip_reason(self) -> str:
        return (
            f"{self.env} is not set: these tests need the local {self.marker} server "
            "(.ci/run starts it from ../shared/objstore/)"
        )

    def configured(self) -> bool:
        return bool(os.environ.get(self.env))


SERVERS = {
    "s3": TestServer("s3", "s3", ENDPOINT_VAR, "s3_bucket"),
    "gs": TestServer("gs", "gcs", "STORAGE_EMULATOR_HOST", "gcs_bucket"),
    "az": TestServer("az", "azure", "AZURITE_BLOB_STORAGE_URL", "azure_container"),
}


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", "gcs: needs the local GCS emulator (started by .ci/run)")
    config.addinivalue_line("markers", "azure: needs Azurite (started by .ci/run)")


def store_params() -> list[Any]:
    """pytest params of the three remote stores, each with its marker."""
    return [pytest.param(s, marks=getattr(pytest.mark, SERVERS[s].marker), id=s) for s in SERVERS]


def bucket_url(request: Any, scheme: str) -> str:
    """`scheme://bucket` on the store's test server (skips when it is not configured)."""
    return f"{scheme}://{request.getfixturevalue(SERVERS[scheme].fixture)}"


def fresh_prefix(request: Any, scheme: str) -> str:
    return f"{bucket_url(request, scheme)}/{uuid.uuid4().hex[:12]}"


def create_bucket(prefix: str = "snapshard-test") -> str:
    """A new, empty bucket on the configured S3 endpoint; returns its name."""
    import obstore
    from obstore.store import S3Store

    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    url = obstore.sign(S3Store(name), "PUT", "", timedelta(minutes=5))
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="PUT"), timeout=30):
            pass
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"cannot create bucket {name}: {e.code} {e.read()[:300]!r}") from e
    return name


def _require(scheme: str) -> None:
    if not SERVERS[scheme].configured():
        pytest.skip(SERVERS[scheme].skip_reason)


@pytest.fixture(scope="session")
def s3_bucket() -> str:
    """A bucket for this test session on the local S3 server."""
    _require("s3")
    return create_bucket()


@pytest.fixture(scope="session")
def gcs_bucket() -> str:
    """The GCS emulator's bucket (tests work under fresh prefixes)."""
    _require("gs")
    return os.environ.get("GCS_BUCKETS", "ckpt").split(",")[0]


@pytest.fixture(scope="session")
def azure_container() -> str:
    """Azurite's container (tests work under fresh prefixes)."""
    _require("az")
    return os.environ.get("AZURE_CONTAINERS", "ckpt").split(",")[0]


@pytest.fixture(params=store_params())
def remote_prefix(request: Any) -> str:
    """A fresh, empty prefix on each configured remote store."""
    return fresh_prefix(request, request.param)
