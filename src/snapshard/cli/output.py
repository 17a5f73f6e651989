"""What the commands print: a JSON document (--json) or text, one-line errors, progress bars."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, Protocol


class Progress(Protocol):
    def update(self, n: int) -> None: ...


class _NoProgress:
    def update(self, n: int) -> None:
        pass


class Output:
    """Where a command's result, errors and progress go."""

    def __init__(self, *, json_mode: bool, progress: bool):
        self.json_mode = json_mode
        self.show_progress = progress and not json_mode

    def result(self, doc: dict[str, Any], text: Callable[[], str]) -> None:
        if self.json_mode:
            print(json.dumps(doc, indent=2, allow_nan=False, default=str))
        else:
            print(text())

    def error(self, message: str) -> None:
        """One line on stderr (and a JSON document on stdout for scripts)."""
        line = " ".join(message.split())
        if self.json_mode:
            print(json.dumps({"error": line}))
        print(f"snapshard: error: {line}", file=sys.stderr)

    @contextmanager
    def progress(self, total: int, desc: str) -> Iterator[Progress]:
        """A progress bar in bytes on stderr when it is a terminal and tqdm is installed."""
        if not (self.show_progress and sys.stderr.isatty()):
            yield _NoProgress()
            return
        try:
            from tqdm import tqdm
        except ImportError:
            yield _NoProgress()
            return
        with tqdm(
            total=total,
            desc=desc,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            leave=False,
            ncols=_bar_width(),
        ) as bar:
            yield bar


def format_metrics(metrics: Any) -> str:
    """A manager's step metrics, short: 'loss=0.25 acc=0.9' ('' for none)."""
    if not isinstance(metrics, dict) or not metrics:
        return ""
    return " ".join(
        f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()
    )


def _bar_width() -> int | None:
    """None (tqdm sizes the bar) unless the terminal reports no width, as some terminals and
    pseudo-terminals do: then 80 columns, not a bar of width 0."""
    try:
        columns = os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError, AttributeError):
        columns = shutil.get_terminal_size((0, 0)).columns
    return None if columns > 0 else 80


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    exp = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024**exp:.1f} {'KMGT'[exp - 1]}iB"


def iso_time(unix: float | None) -> str | None:
    if not unix:
        return None
    return datetime.fromtimestamp(unix, tz=UTC).isoformat(timespec="seconds")


def json_value(v: Any) -> Any:
    """A Python value of a checkpoint as JSON (non-finite floats as strings)."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *rows]
    )


def describe_sharding(s: dict[str, Any] | None) -> str:
    """A saved sharding description, short."""
    if not s:
        return "-"
    kind = str(s.get("type", "?"))
    if kind == "host":
        return "host"
    if "mesh" in s:
        mesh = ",".join(f"{k}={v}" for k, v in s["mesh"].items())
        # JAX layouts name a partition spec, torch's DTensor placements (`S(0)`, `R`)
        parts = s["placements"] if "placements" in s else s.get("spec", [])
        spec = ", ".join("None" if p is None else str(p) for p in parts)
        return f"{kind}({mesh}; {spec})"
    return kind
