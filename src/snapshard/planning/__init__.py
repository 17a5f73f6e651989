"""Pure planning: layouts in, write and read plans out. No I/O, no JAX."""

from .layout import ArrayLayout, ShardGroups
from .overlaps import (
    ChunkIndex,
    ReadRange,
    RunGrid,
    coalesce_runs,
    overlap_runs,
    run_grid,
    whole_grid,
)
from .write_plan import MODES, ArrayWritePlan, WritePlan, band_bounds, plan_writes

__all__ = [
    "MODES",
    "ArrayLayout",
    "ArrayWritePlan",
    "ChunkIndex",
    "ReadRange",
    "RunGrid",
    "ShardGroups",
    "WritePlan",
    "band_bounds",
    "coalesce_runs",
    "overlap_runs",
    "plan_writes",
    "run_grid",
    "whole_grid",
]
