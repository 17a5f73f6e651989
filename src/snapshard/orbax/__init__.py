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
"""

from __future__ import annotations

from .checkpointable import CheckpointableHandler
from .handler import Handler, Restore, Save

__all__ = ["CheckpointableHandler", "Handler", "Restore", "Save"]
