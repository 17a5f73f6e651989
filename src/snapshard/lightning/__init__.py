"""snapshard for PyTorch Lightning: a `CheckpointIO` that writes each checkpoint as a
snapshard checkpoint (a directory at the path Lightning names, `epoch=0-step=4.ckpt`).

    trainer = lightning.Trainer(plugins=[snapshard.lightning.CheckpointIO()])
    # saving in a background thread:
    plugins=[snapshard.lightning.AsyncCheckpointIO(snapshard.lightning.CheckpointIO())]
    # sharded state (FSDP2/TP, FSDP): the strategies, which bypass the CheckpointIO
    trainer = lightning.Trainer(strategy=snapshard.lightning.ModelParallelStrategy(...))

Lightning's dict as snapshard leaves (pickled.py), the plugins (checkpoint_io.py), the
strategies' sharded checkpoints (sharded.py), checkpoints Lightning wrote before the switch
(migration.py) and the model read whole outside a Trainer (whole_model.py). Needs the
`lightning` extra. See docs/integrations.md.
"""

from .checkpoint_io import AsyncCheckpointIO, CheckpointIO
from .pickled import PICKLED, UntrustedPickleError
from .sharded import MODEL, OTHER, FSDPStrategy, ModelParallelStrategy, load_sharded, save_sharded
from .whole_model import load_from_checkpoint, to_lightning_file

__all__ = [
    "MODEL",
    "OTHER",
    "PICKLED",
    "AsyncCheckpointIO",
    "CheckpointIO",
    "FSDPStrategy",
    "ModelParallelStrategy",
    "UntrustedPickleError",
    "load_from_checkpoint",
    "load_sharded",
    "save_sharded",
    "to_lightning_file",
]
