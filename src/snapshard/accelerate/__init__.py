"""snapshard for Hugging Face Accelerate: `accelerator.save_state(dir)` / `load_state(dir)`
store the models' weights as one snapshard checkpoint, `dir/snapshard_models`.

    handles = snapshard.accelerate.use_snapshard(accelerator)   # once, after creating it

The models go through Accelerate's state hooks (hooks.py), FSDP's sharded state through
Accelerate's FSDP functions, replaced (fsdp.py), and a state directory whose save_state did
not finish is refused (incomplete.py). Needs the `accelerate` extra. See
docs/integrations.md.
"""

from .fsdp import (
    fsdp_functions,
    load_fsdp_model,
    load_fsdp_optimizer,
    save_fsdp_model,
    save_fsdp_optimizer,
    stop_using,
)
from .hooks import NAME, load_hook, save_hook, use_snapshard
from .incomplete import INCOMPLETE, refuse_incomplete

__all__ = [
    "INCOMPLETE",
    "NAME",
    "fsdp_functions",
    "load_fsdp_model",
    "load_fsdp_optimizer",
    "load_hook",
    "refuse_incomplete",
    "save_fsdp_model",
    "save_fsdp_optimizer",
    "save_hook",
    "stop_using",
    "use_snapshard",
]
