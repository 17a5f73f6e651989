"""`snapshard convert SRC DST --to snapshard|safetensors`: rewrite a checkpoint in another format.

Sources: snapshard and Orbax checkpoints, safetensors files, and PyTorch DCP checkpoints
(to snapshard only, with --trust-pickle: DCP's metadata is a pickle; see torch/dcp.py). To snapshard, arrays are
streamed chunk by chunk (each source chunk cut into slabs of at most --chunk-mb), so memory
holds one slab, and the new checkpoint appears atomically when complete. To safetensors,
each array is read and written in slabs of whole rows of at most --chunk-mb (at least one
row), tensors named by their path joined with '.' (or chosen, renamed and transposed with
--select, --rename, --transpose: the rules of snapshard.safetensors.save); Python values
have no place in a safetensors file and are listed as skipped. The source is never written
to.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..dtypes import dtype_from_name
from ..errors import CheckpointExistsError, SnapshardError
from ..format import MANIFEST_NAME, ArrayLeaf, Manifest
from ..format.kinds import LeafKind
from ..saving.box_writer import CheckpointWriter
from ..storage import storage_for
from ..storage.location import local_path
from .ls import open_for_command
from .options import add_memory_option, megabytes
from .output import Output, human_bytes
from .reader import CheckpointReader, chunk_slabs

FORMATS = ("snapshard", "safetensors")


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "convert", parents=[common], help="convert a checkpoint to snapshard or safetensors"
    )
    p.add_argument(
        "src", help="a snapshard, Orbax or PyTorch DCP checkpoint, or a safetensors file"
    )
    p.add_argument("dst", help="where to write (must not exist unless --overwrite)")
    p.add_argument("--to", choices=FORMATS, default="snapshard", help="format to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    p.add_argument(
        "--trust-pickle",
        action="store_true",
        help="let torch unpickle a DCP checkpoint's .metadata (runs code the file names: "
        "only for checkpoints from a source you trust); needed to convert DCP checkpoints",
    )
    add_memory_option(p, "--chunk-mb", "largest chunk written, and data held in memory")
    st = p.add_argument_group(
        "to safetensors", "the same rules as snapshard.safetensors.save (see docs/safetensors.md)"
    )
    st.add_argument(
        "--select",
        action="append",
        default=[],
        metavar="PATTERN",
        help="write only leaves whose dotted name matches (glob, or a prefix: 'params'); repeatable",
    )
    st.add_argument(
        "--rename",
        action="append",
        nargs=2,
        default=[],
        metavar=("REGEX", "REPLACEMENT"),
        help="re.sub on the tensor names, in order; repeatable",
    )
    st.add_argument(
        "--transpose",
        action="append",
        default=[],
        metavar="PATTERN",
        help="reverse the axes of tensors whose (renamed) name matches this glob; repeatable",
    )
    st.add_argument(
        "--prng-keys",
        choices=("data", "skip", "refuse"),
        default="data",
        help="PRNG keys as their uint32 key data (default), left out, or an error",
    )
    st.add_argument(
        "--max-file-mb",
        type=megabytes,
        default=None,
        dest="max_file_bytes",
        metavar="MIB",
        help="write DST as a directory of files of at most this size with an index",
    )
    p.set_defaults(run=run)


def check_destination(src_url: str, dst: str) -> None:
    """Refuse a destination that is the source or lies inside it: convert never writes there."""
    a, b = local_path(src_url), local_path(dst)
    if a is not None and b is not None:
        a, b = os.path.abspath(a), os.path.abspath(b)
        clash = b == a or os.path.commonpath([a, b]) == a
    else:
        clash = src_url.rstrip("/") == dst.rstrip("/") or dst.startswith(src_url.rstrip("/") + "/")
    if clash:
        raise SnapshardError(f"{dst}: the destination is the source or inside it")


def to_snapshard(
    reader: CheckpointReader, dst: str, out: Output, overwrite: bool, chunk_bytes: int
) -> dict[str, Any]:
    m = reader.manifest
    writer = CheckpointWriter(dst, overwrite=overwrite, extra={"converted_from": reader.format})
    try:
        with out.progress(sum(a.nbytes for a in m.arrays), "convert") as bar:
            for leaf in m.leaves:
                if not isinstance(leaf, ArrayLeaf):
                    writer.add_value(leaf.path, leaf.value)
                    continue
                i = writer.add_array(
                    leaf.path,
                    kind=leaf.kind,
                    dtype=leaf.dtype,
                    shape=leaf.shape,
                    sharding=leaf.sharding,
                    key_impl=leaf.key_impl,
                )
                for _, (start, stop) in chunk_slabs(leaf, chunk_bytes):
                    box = reader.read_box(leaf, start, stop)
                    writer.write_box(i, start, stop, box)
                    bar.update(box.nbytes)
        written = writer.commit(m.structure)
    except BaseException:
        writer.abort()
        raise
    finally:
        writer.close()
    return {
        "destination": writer.url,
        "chunks": sum(len(a.chunks) for a in written.arrays),
        "files": len(written.files),
        "skipped": [],
    }


def row_slabs(
    leaf: ArrayLeaf, slab_bytes: int, transpose: bool = False
) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Boxes of whole leading-axis rows (contiguous in C order) of at most `slab_bytes`
    (at least one row), with their byte offset in the array. With `transpose`, the boxes
    and offsets are those of the array with its axes reversed."""
    shape = tuple(reversed(leaf.shape)) if transpose else leaf.shape
    if not shape or math.prod(shape) == 0:
        return [((0,) * len(shape), shape, 0)] if not shape else []
    row = math.prod(shape[1:]) * dtype_from_name(leaf.dtype).itemsize
    rows = max(1, slab_bytes // max(row, 1))
    return [
        ((r, *(0,) * (len(shape) - 1)), (min(r + rows, shape[0]), *shape[1:]), r * row)
        for r in range(0, shape[0], rows)
    ]


def to_safetensors(
    reader: CheckpointReader, out: Output, args: argparse.Namespace
) -> dict[str, Any]:
    from ..safetensors.names import export_names, leaf_name  # (imported by this command only)
    from ..safetensors.streamed import StreamedTensor, save_streamed

    names = export_names(args.select, args.rename, args.transpose, args.prng_keys)
    chosen, skipped = _chosen_leaves(reader.manifest, names, leaf_name)
    tensors = []
    renamed: dict[str, str] = {}
    for (_, leaf), (_, new, transpose) in zip(
        chosen, names.plan([n for n, _ in chosen]), strict=True
    ):
        shape = tuple(reversed(leaf.shape)) if transpose else leaf.shape
        slabs = _slabs_of(reader, leaf, args.chunk_bytes, transpose)
        tensors.append(StreamedTensor(new, dtype_from_name(leaf.dtype), shape, slabs))
        renamed[new] = leaf.name
    with out.progress(sum(leaf.nbytes for _, leaf in chosen), "convert") as bar:
        result = save_streamed(args.dst, tensors, overwrite=args.overwrite,
                               progress=bar.update, max_file_bytes=args.max_file_bytes)  # fmt: skip
    return {
        "destination": os.path.abspath(args.dst),
        "arrays": len(chosen),  # (what was written, where a selection leaves leaves out)
        "bytes": sum(leaf.nbytes for _, leaf in chosen),
        "skipped": skipped,
        "files": result.files,
        "names": renamed,
    }


def _chosen_leaves(
    m: Manifest, names: Any, leaf_name: Callable[[Any], str]
) -> tuple[list[tuple[str, ArrayLeaf]], list[str]]:
    """The arrays `names` selects, with their default tensor names, and the leaves left
    out: values (safetensors holds arrays only) and PRNG keys under prng_keys='skip'."""
    names.check_selected([leaf_name(leaf.path) for leaf in m.leaves])
    skipped = [
        leaf.name
        for leaf in m.leaves
        if not isinstance(leaf, ArrayLeaf) and names.selects(leaf_name(leaf.path))
    ]
    chosen: list[tuple[str, ArrayLeaf]] = []
    for leaf in m.arrays:
        name = leaf_name(leaf.path)
        if not names.selects(name):
            continue
        if leaf.kind == LeafKind.PRNG_KEY and not names.check_key(leaf.name):
            skipped.append(leaf.name)
            continue
        chosen.append((name, leaf))
    return chosen, skipped


def _slabs_of(
    reader: CheckpointReader, leaf: ArrayLeaf, slab_bytes: int, transpose: bool
) -> Callable[[], Iterator[tuple[int, np.ndarray]]]:
    """The slabs of a tensor, read box by box when the export writes them."""
    if not transpose:
        return lambda: (
            (off, reader.read_box(leaf, a, b)) for a, b, off in row_slabs(leaf, slab_bytes)
        )
    # A row slab of the transposed tensor is a slab of the source's last axis, transposed.
    return lambda: (
        (off, reader.read_box(leaf, a[::-1], b[::-1]).transpose())
        for a, b, off in row_slabs(leaf, slab_bytes, transpose=True)
    )


def _exists_error(e: CheckpointExistsError) -> CheckpointExistsError:
    """The library's 'pass overwrite=True' said as the command line says it."""
    text = (
        str(e)
        .replace("pass overwrite=True", "pass --overwrite")
        .replace("pass overwrite", "pass --overwrite")
    )
    return CheckpointExistsError(text)


def run(args: argparse.Namespace, out: Output) -> int:
    try:
        return _run(args, out)
    except CheckpointExistsError as e:
        raise _exists_error(e) from None


def _is_dcp(location: str) -> bool:
    local = local_path(location)
    return (
        local is not None
        and os.path.isdir(local)
        and os.path.isfile(os.path.join(local, ".metadata"))
        and not os.path.isfile(os.path.join(local, MANIFEST_NAME))
    )


def _run_dcp(args: argparse.Namespace, out: Output) -> int:
    """A DCP checkpoint, read through torch's own reader (see snapshard.torch.dcp)."""
    src = local_path(args.src)
    assert src is not None
    if args.to != "snapshard":
        raise SnapshardError(f"{args.src}: a DCP checkpoint converts to snapshard only (--to)")
    try:
        from ..torch.dcp import DcpCheckpoint, refusal
    except ImportError as e:
        raise SnapshardError(
            f"{args.src} is a PyTorch DCP checkpoint; converting it needs torch: install "
            f"snapshard[torch] ({e})"
        ) from None
    if not args.trust_pickle:
        raise refusal(args.src)
    with storage_for(args.dst) as dst:
        check_destination(os.path.abspath(src), dst.url)
        destination = dst.url
    ckpt = DcpCheckpoint(src, trust_pickle=True)
    with out.progress(ckpt.tensor_bytes, "convert") as bar:
        written = ckpt.write_snapshard(
            args.dst, overwrite=args.overwrite, chunk_bytes=args.chunk_bytes, progress=bar.update
        )
    doc: dict[str, Any] = {
        "source": os.path.abspath(src),
        "source_format": "dcp",
        "format": "snapshard",
        "leaves": ckpt.entries,
        "arrays": ckpt.tensors,
        "bytes": ckpt.tensor_bytes,
        "destination": destination,
        "chunks": sum(len(a.chunks) for a in written.arrays),
        "files": len(written.files),
        "skipped": [],
    }
    out.result(
        doc,
        lambda: (
            f"{doc['source']} (dcp) -> {doc['destination']} (snapshard): {doc['arrays']} "
            f"arrays, {human_bytes(doc['bytes'])}"
        ),
    )
    return 0


def _run(args: argparse.Namespace, out: Output) -> int:
    if _is_dcp(args.src):
        return _run_dcp(args, out)
    with open_for_command(args.src, "convert") as reader:
        if args.to == "snapshard":
            with storage_for(args.dst) as dst:
                check_destination(reader.url, dst.url)
            result = to_snapshard(reader, args.dst, out, args.overwrite, args.chunk_bytes)
        else:
            check_destination(reader.url, args.dst)
            result = to_safetensors(reader, out, args)
        m = reader.manifest
        doc = {
            "source": reader.url,
            "source_format": reader.format,
            "format": args.to,
            "leaves": len(m.leaves),
            "arrays": len(m.arrays),
            "bytes": sum(a.nbytes for a in m.arrays),
            **result,
        }

    def text() -> str:
        line = (
            f"{doc['source']} ({doc['source_format']}) -> {doc['destination']} ({doc['format']}): "
            f"{doc['arrays']} arrays, {human_bytes(doc['bytes'])}"
        )
        if doc["skipped"]:
            n = len(doc["skipped"])
            line += f"; skipped {n} {'leaf' if n == 1 else 'leaves'}: {', '.join(doc['skipped'])}"
        return line

    out.result(doc, text)
    return 0
