"""Checkpoint locations parsed once: a local path, a file:// URL, or an object-store URL
(scheme://bucket/key/prefix). Every module that needs a location's scheme, bucket, key
prefix, filesystem path, parent or name asks a ParsedLocation. Pure: no I/O here."""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlparse

OBJECT_STORE_SCHEMES = ("s3", "gs", "az", "azure", "abfs", "memory")
LOCAL_SCHEMES = ("", "file")


@dataclass(frozen=True)
class ParsedLocation:
    """A location as given (`text`) and its parts: `scheme` ("" for a plain path), `bucket`
    (an object store's bucket or container, "" otherwise) and `path` (a filesystem path for
    local locations, the key prefix without leading or trailing "/" for object stores)."""

    text: str
    scheme: str
    bucket: str
    path: str

    @property
    def is_local(self) -> bool:
        return self.scheme in LOCAL_SCHEMES

    @property
    def is_object_store(self) -> bool:
        return self.scheme in OBJECT_STORE_SCHEMES

    @property
    def local_path(self) -> str | None:
        """The filesystem path of a local location (a path, or a file:// URL's path)."""
        return self.path if self.is_local else None

    def parent_and_name(self) -> tuple[str, str]:
        """(parent, last component) of the location: for a plain path, of its absolute
        form; for a URL, of its text ("s3://b/run/step_9" -> ("s3://b/run", "step_9"))."""
        text = os.path.abspath(self.text) if not self.scheme else self.text
        parent, _, name = text.rstrip("/").rpartition("/")
        return parent, name

    def sibling(self, name: str) -> str:
        """The location `name` beside this one, under the same parent."""
        return f"{self.parent_and_name()[0]}/{name}"


def parse_location(location: str | os.PathLike[str]) -> ParsedLocation:
    """The parts of a checkpoint location (no check that its scheme is supported: see
    `require_supported`)."""
    text = os.fspath(location)
    u = urlparse(text)
    if u.scheme == "":
        return ParsedLocation(text, "", "", text)
    if u.scheme == "file":
        return ParsedLocation(text, "file", "", u.path)
    return ParsedLocation(text, u.scheme, u.netloc, u.path.strip("/"))


def require_supported(location: ParsedLocation) -> ParsedLocation:
    """The location, if some storage backend serves its scheme; else a ValueError."""
    if not (location.is_local or location.is_object_store):
        raise ValueError(
            f"unsupported checkpoint location {location.text!r} (scheme {location.scheme!r})"
        )
    return location


def local_path(location: str) -> str | None:
    """The filesystem path of a local location (a path or file:// URL); None for a URL."""
    return parse_location(location).local_path
