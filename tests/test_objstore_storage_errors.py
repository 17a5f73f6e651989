"""Object-store failures on the read side and at a manager's start are StorageErrors naming
the URL, the object and the operation (faults injected by tests/faultproxy.py)."""

from __future__ import annotations

import os
import uuid
from datetime import timedelta

import numpy as np
import pytest

import snapshard
from faultproxy import FaultProxy
from s3env import ENDPOINT_VAR
from snapshard.errors import StorageError
from snapshard.manager import LeasePolicy, ManagerPolicies
from snapshard.storage.lease import LEASE_DIR
from snapshard.storage.objstore import ObjectRoot, ObjectStorage

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]

OPTIONS = {
    "client_options": {"allow_http": True, "timeout": "2s", "connect_timeout": "2s"},
    "retry_config": {
        "max_retries": 2,
        "backoff": {
            "init_backoff": timedelta(milliseconds=20),
            "max_backoff": timedelta(milliseconds=100),
            "base": 2,
        },
        "retry_timeout": timedelta(seconds=20),
    },
}


@pytest.fixture
def proxy(s3_bucket):
    with FaultProxy(os.environ[ENDPOINT_VAR]) as p:
        yield p


@pytest.fixture
def base(s3_bucket):
    return f"s3://{s3_bucket}/{uuid.uuid4().hex[:12]}"


def test_a_denied_read_is_a_storage_error_naming_the_object(proxy, base):
    snapshard.save(f"{base}/ckpt", {"w": np.arange(4096.0)})
    st = ObjectStorage(f"{base}/ckpt", {"endpoint": proxy.url, **OPTIONS})
    proxy.add("GET", "/data/", "status", times=10_000, status=403)
    with pytest.raises(StorageError, match=rf"{base}/ckpt: access denied to read of 'data/"):
        snapshard.load(st)


def test_a_failing_store_at_manager_start_is_a_storage_error_and_writes_nothing(proxy, base):
    root = ObjectRoot(f"{base}/run", {"endpoint": proxy.url, **OPTIONS})
    proxy.add("PUT", LEASE_DIR, "status", times=10_000, status=503)
    with pytest.raises(StorageError, match=rf"{base}/run/{LEASE_DIR}: .*'00000001.json' failed"):
        snapshard.CheckpointManager(
            root, policies=ManagerPolicies(lease=LeasePolicy(at_start=True))
        )
    assert ObjectRoot(f"{base}/run").client.listing() == {}
    proxy.clear()
    with snapshard.CheckpointManager(root) as m:
        m.save(1, {"w": np.arange(3.0)})
    assert ObjectRoot(f"{base}/run").list() == {"1": True}
