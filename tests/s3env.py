"""The local S3-compatible test server: is it configured, and making buckets on it.

.ci/run starts the server and exports AWS_ENDPOINT_URL, the credentials and AWS_ALLOW_HTTP;
tests marked `s3` skip when AWS_ENDPOINT_URL is not set. obstore cannot create buckets, so
a bucket is made with a presigned PUT of the bucket itself.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
import uuid
from datetime import timedelta

import pytest

ENDPOINT_VAR = "AWS_ENDPOINT_URL"
SKIP_REASON = (
    f"{ENDPOINT_VAR} is not set: these tests need the local S3 server "
    "(.ci/run starts it with ../shared/objstore/s3-server.sh)"
)


def endpoint() -> str | None:
    return os.environ.get(ENDPOINT_VAR) or None


def create_bucket(prefix: str = "snapshard-test") -> str:
    """A new, empty bucket on the configured endpoint; returns its name."""
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


@pytest.fixture(scope="session")
def s3_bucket() -> str:
    """A bucket for this test session on the local server; skips when there is none."""
    if endpoint() is None:
        pytest.skip(SKIP_REASON)
    return create_bucket()
