"""Command-line options shared by several commands."""

from __future__ import annotations

import argparse
import fnmatch
from collections.abc import Callable

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


# What a text listing shows of a checkpoint's leaves unless --all or --limit says otherwise:
# enough to see a tree's shape, few enough that 100,000 leaves stay readable.
DEFAULT_LIMIT = 50


def add_listing_options(p: argparse.ArgumentParser, what: str) -> None:
    """--limit N / --all: how many `what` a command prints (args.limit: None for the
    default, 0 for all), and --select PATTERN (args.select) to choose them by leaf name."""
    shown = p.add_mutually_exclusive_group()
    shown.add_argument(
        "--limit",
        type=_count,
        default=None,
        metavar="N",
        help=f"print the first N {what} (text: {DEFAULT_LIMIT} by default; --json: all)",
    )
    shown.add_argument(
        "--all", dest="limit", action="store_const", const=0, help=f"print every one of the {what}"
    )
    p.add_argument(
        "--select",
        action="append",
        default=[],
        metavar="PATTERN",
        help="only leaves whose name (keys joined by '/') matches this glob or starts with "
        "this prefix and '/'; repeatable",
    )


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return n


def shown_count(limit: int | None, json_mode: bool) -> int | None:
    """How many entries a listing prints (None: all) from args.limit and the output mode."""
    if limit == 0 or (limit is None and json_mode):
        return None
    return DEFAULT_LIMIT if limit is None else limit


def name_selector(patterns: list[str]) -> Callable[[str], bool] | None:
    """A test of leaf names for --select (None: every leaf)."""
    if not patterns:
        return None
    return lambda name: any(
        name == p or name.startswith(p.rstrip("/") + "/") or fnmatch.fnmatchcase(name, p)
        for p in patterns
    )
