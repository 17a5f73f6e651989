"""Safetensors test files written by the safetensors library itself (shared by several tests)."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from safetensors.torch import save_file

# name -> (shape, NumPy dtype); torch writes every dtype, BF16 and F8 included.
TENSORS = {
    "embed.weight": ((64, 32), np.float32),
    "layers.0.attn.q_proj.weight": ((32, 32), ml_dtypes.bfloat16),
    "layers.0.attn.k_proj.weight": ((16, 32), ml_dtypes.bfloat16),
    "layers.0.mlp.weight": ((48, 32), np.float16),
    "layers.0.norm.weight": ((32,), np.float32),
    "layers.1.fp8.weight": ((16, 8), ml_dtypes.float8_e4m3fn),
    "layers.1.fp8b.weight": ((8, 8), ml_dtypes.float8_e5m2),
    "layers.1.ids": ((24,), np.int32),
    "layers.1.mask": ((8, 4), np.bool_),
    "layers.1.count": ((), np.int64),
    "layers.1.u8": ((16, 3), np.uint8),
}


def reference(seed: int = 0) -> dict[str, np.ndarray]:
    """The tensors, as bit patterns that are valid for every dtype (no NaN payload games)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (shape, dt) in TENSORS.items():
        dt = np.dtype(dt)
        if dt == np.bool_:
            out[name] = rng.integers(0, 2, shape).astype(bool)
        elif dt.kind in "iu":
            out[name] = np.asarray(rng.integers(0, 100, shape)).astype(dt)
        else:
            out[name] = rng.uniform(-4, 4, shape).astype(np.float32).astype(dt)
    return out


def _torch(a: np.ndarray) -> torch.Tensor:
    special = {
        "bfloat16": (torch.int16, torch.bfloat16),
        "float8_e4m3fn": (torch.uint8, torch.float8_e4m3fn),
        "float8_e5m2": (torch.uint8, torch.float8_e5m2),
    }
    if a.dtype.name in special:
        raw, dt = special[a.dtype.name]
        view = np.array(a).view(np.int16 if raw == torch.int16 else np.uint8)
        return torch.from_numpy(view.copy()).view(dt)
    return torch.from_numpy(np.array(a))


def write_single(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    save_file({k: _torch(v) for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    return path


def write_sharded(directory: Path, tensors: dict[str, np.ndarray], n: int = 3) -> Path:
    """n files and a model.safetensors.index.json, as Hugging Face lays them out."""
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for i in range(n):
        file = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        part = {k: tensors[k] for k in names[i::n]}
        write_single(directory / file, part)
        weight_map.update(dict.fromkeys(part, file))
    index = {
        "metadata": {"total_size": sum(v.nbytes for v in tensors.values())},
        "weight_map": weight_map,
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def experts(
    layers: int = 2, n: int = 8, shape: tuple[int, int] = (32, 16)
) -> dict[str, np.ndarray]:
    """A Mixtral-style set of expert tensors, one per expert and layer."""
    rng = np.random.default_rng(3)
    return {
        f"model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight": rng.standard_normal(
            shape
        ).astype(np.float32)
        for i in range(layers)
        for e in range(n)
    }


def export_reference() -> dict[str, np.ndarray]:
    """What the multi-process export writes (the same on every process)."""
    rng = np.random.default_rng(11)
    return {
        "w": rng.standard_normal((64, 48)).astype(np.float32),
        "cols": rng.standard_normal((8, 32)).astype(np.float32),
        "half": rng.standard_normal((16, 8)).astype(np.float16),
        "rep": np.arange(10, dtype=np.int32),
    }
