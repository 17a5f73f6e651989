"""snapshard under Orbax: a checkpoint handler that writes each Orbax item as a snapshard
checkpoint, so that Orbax's `CheckpointManager` keeps its steps, retention, asynchronous saves
and atomic commit, and the bytes are written and read by snapshard.

    import orbax.checkpoint as ocp
    import snapshard.orbax

    mgr = ocp.CheckpointManager(root, item_names=("state",),
                                item_handlers={"state": snapshard.orbax.Handler()})
    mgr.save(step, args=ocp.args.Composite(state=snapshard.orbax.Save(state)))
    state = mgr.restore(step, args=ocp.args.Composite(state=snapshard.orbax.Restore(target)))

`<root>/<step>/state` is then a snapshard checkpoint: `snapshard.load` reads it directly,
onto any mesh or process count. `CheckpointableHandler` is the same for Orbax's v1 API
(`orbax.checkpoint.experimental.v1`). Needs orbax-checkpoint; see docs/integrations.md.

The package also reads checkpoints that Orbax wrote (`reader.py`, through TensorStore;
`foreign.py`, the hook through which `snapshard.load` and `snapshard.metadata` find one), so
its names are imported on first use: reading an Orbax checkpoint needs no orbax-checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_getattr

if TYPE_CHECKING:
    from .checkpointable import CheckpointableHandler
    from .handler import Handler, Restore, Save

__getattr__ = lazy_getattr(
    __name__,
    {
        "CheckpointableHandler": "checkpointable",
        "Handler": "handler",
        "Restore": "handler",
        "Save": "handler",
    },
)

__all__ = ["CheckpointableHandler", "Handler", "Restore", "Save"]
