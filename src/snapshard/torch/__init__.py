"""snapshard for PyTorch: state dicts of tensors and DTensors (FSDP2, tensor parallel).

    snapshard.torch.save(path, state_dict)            # every rank; atomic; no collective
    job = snapshard.torch.save_async(path, state_dict) # returns once owned bytes are on host
    snapshard.torch.load(path, target_state_dict)     # in place, onto any mesh / world size
    snapshard.torch.metadata(path)                    # shapes, dtypes, saved placements
    snapshard.torch.CheckpointManager(directory)      # numbered steps, policies, retention
    dcp.save(state, storage_writer=snapshard.torch.StorageWriter(path))  # DCP, snapshard format

Same planner, format and storage as the JAX side: a checkpoint written by one is read by
the other. Needs the `torch` extra. See docs/torch.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..coordination.peer_memory import release_kept as release_shared_memory
from ..inspection import metadata
from ..lazy import lazy_getattr
from ..options import ReadOptions, SaveOptions
from .coordination import TorchStoreCoordinator, default_coordinator
from .layout import ShardSpec, TensorLayout, expand_submesh, local_shape_and_offset, tensor_layout
from .leaves import dtensor_layout
from .loading import load
from .manager import TORCH, CheckpointManager
from .saving import AsyncSave, HostBuffers, save, save_async

if TYPE_CHECKING:
    from .dcp import convert_dcp
    from .dcp_manifest import DcpStorageError
    from .dcp_reading import StorageReader, load_pickled
    from .dcp_storage import StorageWriter

# What needs torch.distributed.checkpoint is imported on first use (it takes about as long
# to import as the rest of snapshard.torch).
_LAZY = {
    "convert_dcp": "dcp",
    "StorageReader": "dcp_reading",
    "load_pickled": "dcp_reading",
    "DcpStorageError": "dcp_manifest",
    "StorageWriter": "dcp_storage",
}


__getattr__ = lazy_getattr(__name__, _LAZY, modules=("dcp",))


__all__ = [
    "TORCH",
    "AsyncSave",
    "CheckpointManager",
    "DcpStorageError",
    "HostBuffers",
    "ReadOptions",
    "SaveOptions",
    "ShardSpec",
    "StorageReader",
    "StorageWriter",
    "TensorLayout",
    "TorchStoreCoordinator",
    "convert_dcp",
    "default_coordinator",
    "dtensor_layout",
    "expand_submesh",
    "load",
    "load_pickled",
    "local_shape_and_offset",
    "metadata",
    "release_shared_memory",
    "save",
    "save_async",
    "tensor_layout",
]
