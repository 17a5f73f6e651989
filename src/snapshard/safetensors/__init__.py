"""Safetensors and Hugging Face checkpoints straight onto a mesh, and back.

snapshard.safetensors.load(path, target)        # each process reads only its shards' bytes
snapshard.safetensors.load(path)                 # every tensor as NumPy
snapshard.safetensors.save(path, tree)           # every process writes its own byte runs
snapshard.safetensors.arrays(path, transform)    # names, shapes, dtypes; no data read

Transforms (snapshard.safetensors.surgery) are lazy: composed with `load`, each shard is
computed from just the source bytes it needs.
"""

from . import surgery
from .export import ExportResult, StreamedTensor, save, save_streamed
from .loader import Transform, arrays, load

__all__ = [
    "ExportResult",
    "StreamedTensor",
    "Transform",
    "arrays",
    "load",
    "save",
    "save_streamed",
    "surgery",
]
