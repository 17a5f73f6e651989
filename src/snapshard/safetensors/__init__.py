r"""Safetensors and Hugging Face checkpoints straight onto a mesh, and back.

snapshard.safetensors.load(path, target)        # each process reads only its shards' bytes
snapshard.safetensors.load(path)                 # every tensor as NumPy
snapshard.safetensors.save(path, tree)           # every process writes its own byte runs
snapshard.safetensors.save(path, tree, select="params", rename={r"\.value$": ""})
snapshard.safetensors.arrays(path, transform)    # names, shapes, dtypes; no data read

Transforms (snapshard.safetensors.surgery) are lazy: composed with `load`, each shard is
computed from just the source bytes it needs.
"""

from ..transforms import surgery
from .export import save
from .loader import Transform, arrays, load
from .names import ExportNames, export_names
from .streamed import StreamedTensor, save_streamed
from .writing import ExportResult

__all__ = [
    "ExportNames",
    "ExportResult",
    "StreamedTensor",
    "Transform",
    "arrays",
    "export_names",
    "load",
    "save",
    "save_streamed",
    "surgery",
]
