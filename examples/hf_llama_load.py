"""Load a Hugging Face Llama-style checkpoint into a sharded JAX parameter tree.

Writes a small synthetic checkpoint with the safetensors library (two files and an index,
bfloat16, torch's layout), then loads it onto a (2, 4) mesh with renames, fused q/k/v and
gate/up projections and (in, out) kernels: each device's shard is read from just the source
bytes it covers. Run: python examples/hf_llama_load.py [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import ml_dtypes
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.torch import save_file

import snapshard
import snapshard.safetensors as sst
from snapshard.safetensors import surgery as S

LAYERS, D, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 2, 64, 8, 2, 8, 128, 256


def hf_shapes() -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes as transformers' LlamaForCausalLM saves them."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, D)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (HEADS * HEAD_DIM, D),
            f"{p}.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, D),
            f"{p}.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, D),
            f"{p}.self_attn.o_proj.weight": (D, HEADS * HEAD_DIM),
            f"{p}.mlp.gate_proj.weight": (FFN, D),
            f"{p}.mlp.up_proj.weight": (FFN, D),
            f"{p}.mlp.down_proj.weight": (D, FFN),
            f"{p}.input_layernorm.weight": (D,),
            f"{p}.post_attention_layernorm.weight": (D,),
        }
    return shapes | {"model.norm.weight": (D,), "lm_head.weight": (VOCAB, D)}


def write_checkpoint(directory: Path) -> dict[str, np.ndarray]:
    """Two safetensors files and model.safetensors.index.json, written by the library."""
    rng = np.random.default_rng(0)
    tensors = {
        k: rng.standard_normal(s, dtype=np.float32).astype(ml_dtypes.bfloat16)
        for k, s in hf_shapes().items()
    }
    names = sorted(tensors)
    halves = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    for file, keys in halves.items():
        as_torch = {
            k: torch.from_numpy(tensors[k].view(np.int16)).view(torch.bfloat16) for k in keys
        }
        save_file(as_torch, str(directory / file), metadata={"format": "pt"})
    weight_map = {k: f for f, keys in halves.items() for k in keys}
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
        "weight_map": weight_map,
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return tensors


# HF's torch layout -> our JAX layout: one composable, lazy transformation.
LLAMA_TO_JAX = S.chain(
    # Fused projections: q, k, v stacked along the output axis; gate and up likewise.
    S.fuse(r"(.*)\.self_attn\.(?P<part>q|k|v)_proj\.weight", r"\1.attn.qkv", ["q", "k", "v"]),
    S.fuse(r"(.*)\.mlp\.(?P<part>gate|up)_proj\.weight", r"\1.mlp.gate_up", ["gate", "up"]),
    # torch Linear weights are (out, in); our kernels are (in, out).
    S.transpose(r".*\.(attn\.qkv|mlp\.gate_up|o_proj\.weight|down_proj\.weight)|lm_head\.weight"),
    # Names: drop the "model." prefix and match the parameter tree's keys.
    S.rename(r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", r"layers.\1.attn.out"),
    S.rename(r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", r"layers.\1.mlp.down"),
    S.rename(r"model\.layers\.(\d+)\.input_layernorm\.weight", r"layers.\1.norm_attn"),
    S.rename(r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.norm_mlp"),
    S.rename(r"model\.(layers\..*)", r"\1"),
    S.rename(r"model\.embed_tokens\.weight", "embed"),
    S.rename(r"model\.norm\.weight", "final_norm"),
    S.rename(r"lm_head\.weight", "lm_head"),
)


def param_target(mesh: Mesh) -> dict:
    """The sharded parameter tree to load into (shapes, dtypes, shardings only)."""

    def sds(shape: tuple[int, ...], spec: P) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, ml_dtypes.bfloat16, sharding=NamedSharding(mesh, spec))

    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    layer = {
        "attn": {
            "qkv": sds((D, qkv), P("data", "model")),
            "out": sds((HEADS * HEAD_DIM, D), P("model", "data")),
        },
        "mlp": {
            "gate_up": sds((D, 2 * FFN), P("data", "model")),
            "down": sds((FFN, D), P("model", "data")),
        },
        "norm_attn": sds((D,), P()),
        "norm_mlp": sds((D,), P()),
    }
    return {
        "embed": sds((VOCAB, D), P("model", None)),
        "layers": {str(i): layer for i in range(LAYERS)},
        "final_norm": sds((D,), P()),
        "lm_head": sds((D, VOCAB), P(None, "model")),
    }


def reference(t: dict[str, np.ndarray]) -> dict:
    """The same parameters computed eagerly with NumPy, to check the lazy load against."""

    def layer(i: int) -> dict:
        p = f"model.layers.{i}"
        qkv = np.concatenate([t[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv"]).T
        gate_up = np.concatenate([t[f"{p}.mlp.gate_proj.weight"], t[f"{p}.mlp.up_proj.weight"]]).T
        return {
            "attn": {"qkv": qkv, "out": t[f"{p}.self_attn.o_proj.weight"].T},
            "mlp": {"gate_up": gate_up, "down": t[f"{p}.mlp.down_proj.weight"].T},
            "norm_attn": t[f"{p}.input_layernorm.weight"],
            "norm_mlp": t[f"{p}.post_attention_layernorm.weight"],
        }

    return {
        "embed": t["model.embed_tokens.weight"],
        "layers": {str(i): layer(i) for i in range(LAYERS)},
        "final_norm": t["model.norm.weight"],
        "lm_head": t["lm_head.weight"].T,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--dir", help="where to write the synthetic checkpoint (default: a temporary one)"
    )
    args = ap.parse_args()
    directory = Path(args.dir or tempfile.mkdtemp())
    directory.mkdir(parents=True, exist_ok=True)
    tensors = write_checkpoint(directory)

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    stats = snapshard.ReadStats()
    params = sst.load(directory, param_target(mesh), transform=LLAMA_TO_JAX, stats=stats)

    ok = jax.tree_util.tree_all(
        jax.tree_util.tree_map(
            lambda x, want: all(
                np.array_equal(np.asarray(s.data), want[s.index]) for s in x.addressable_shards
            ),
            params,
            reference(tensors),
        )
    )
    qkv = params["layers"]["0"]["attn"]["qkv"]
    print(f"layers.0.attn.qkv: {qkv.shape} {qkv.dtype} sharded {qkv.sharding.spec}")
    print(f"matches the eager NumPy reference: {ok}")
    print(f"bytes needed {stats.bytes_needed}, read {stats.bytes_read} in {stats.reads} reads")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
