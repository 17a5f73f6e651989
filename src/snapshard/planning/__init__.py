"""Pure planning: layouts in, write and read plans out. No I/O, no JAX."""

from .layout import ArrayLayout, ShardGroups
from .read_plan import ChunkIndex, ReadRange, coalesce_runs, overlap_runs
from .write_plan import MODES, ArrayWritePlan, WritePlan, band_bounds, plan_writes

__all__ = [
    "MODES",
    "ArrayLayout",
    "ArrayWritePlan",
    "ChunkIndex",
    "ReadRange",
    "ShardGroups",
    "WritePlan",
    "band_bounds",
    "coalesce_runs",
    "overlap_runs",
    "plan_writes",
]
