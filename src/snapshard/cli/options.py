"""Command-line options shared by several commands."""

from __future__ import annotations

import argparse

DEFAULT_BUFFER_MB = 64


def megabytes(text: str) -> int:
    """An argparse type: a positive number of MiB (fractions allowed), as bytes."""
    try:
        mb = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of MiB: {text!r}") from None
    if not mb > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 MiB: {text!r}")
    return max(1, int(mb * (1 << 20)))


def add_memory_option(
    p: argparse.ArgumentParser,
    flag: str = "--buffer-mb",
    what: str = "most data held in memory at once",
    default_mb: int = DEFAULT_BUFFER_MB,
) -> None:
    """A size in MiB, parsed into bytes (args.<flag>_bytes)."""
    dest = flag.lstrip("-").replace("-mb", "_bytes").replace("-", "_")
    p.add_argument(
        flag,
        dest=dest,
        type=megabytes,
        default=default_mb << 20,
        metavar="MIB",
        help=f"{what}, MiB (default {default_mb})",
    )
