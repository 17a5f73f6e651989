"""Pure planning: layouts in, write and read plans out. No I/O, no JAX."""

from .layout import ArrayLayout
from .overlaps import (
    ChunkIndex,
    ReadRange,
    RunGrid,
    coalesce_runs,
    run_grid,
    whole_grid,
)
from .write_plan import MODES, WritePlan, plan_writes

__all__ = [
    "MODES",
    "ArrayLayout",
    "ChunkIndex",
    "ReadRange",
    "RunGrid",
    "WritePlan",
    "coalesce_runs",
    "plan_writes",
    "run_grid",
    "whole_grid",
]
