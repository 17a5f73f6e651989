"""The read executor's former home: it lives in the snapshard.reading package now (host
buffers, requests, the read plan, the reads, the chunk tables, `execute`). The package's
public names stay importable from here for one release, for code that imports them from
here; the package's own modules import from snapshard.reading.
"""

from __future__ import annotations

from . import reading
from .reading import *  # noqa: F403

__all__ = reading.__all__
