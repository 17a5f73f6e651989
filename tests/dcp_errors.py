"""The error a call through DCP raised on this rank, for tests of DCP's storage seam."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest


def dcp_failure(call: Callable[[], Any], cls: type[BaseException], match: str) -> BaseException:
    """The error `call` raised on this rank, checked to be a `cls` whose message matches
    `match`: DCP reports it wrapped, per rank, in a CheckpointException (a BaseException)
    where it ran the failing step collectively."""
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(BaseException) as info:
        call()
    err = info.value
    if isinstance(err, CheckpointException):
        err = next(iter(err.failures.values()))[0]
    assert isinstance(err, cls), repr(err)
    assert re.search(match, str(err)), str(err)
    return err
