"""The arrays a restore builds from host boxes (jax/assemble.py) are the arrays
jax.make_array_from_callback builds from the same boxes: values, sharding, abstract value,
commitment and shards, on every kind of sharding, through JAX's batched transfer and
through the fallback alike."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from snapshard.jax import assemble as jax_transfer
from snapshard.jax.arrays import local_device_boxes


def _shardings() -> list[tuple[str, jax.sharding.Sharding]]:
    devs = jax.devices()
    out: list[tuple[str, jax.sharding.Sharding]] = [("single", SingleDeviceSharding(devs[0]))]
    if len(devs) >= 4:
        mesh = Mesh(np.array(devs[:4]).reshape(2, 2), ("a", "b"))
        out += [
            ("rows", NamedSharding(mesh, P(("a", "b")))),
            ("grid", NamedSharding(mesh, P("a", "b"))),
            ("partly replicated", NamedSharding(mesh, P("b"))),
            ("replicated", NamedSharding(mesh, P())),
        ]
        shuffled = Mesh(np.array(devs[:4])[[2, 0, 3, 1]].reshape(2, 2), ("a", "b"))
        out.append(("devices out of order", NamedSharding(shuffled, P("a", "b"))))
    return out


def _boxes_and_hosts(
    whole: np.ndarray, sharding: jax.sharding.Sharding
) -> tuple[tuple, list[np.ndarray]]:
    boxes = local_device_boxes(sharding, whole.shape)
    hosts = [np.ascontiguousarray(whole[tuple(map(slice, s, e))]) for s, e, _ in boxes]
    return boxes, hosts


def _same_array(got: jax.Array, want: jax.Array) -> None:
    assert got.sharding == want.sharding
    assert got.aval == want.aval
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.committed == want.committed
    assert [s.device for s in got.addressable_shards] == [s.device for s in want.addressable_shards]
    for a, b in zip(got.addressable_shards, want.addressable_shards, strict=True):
        assert a.index == b.index
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("direct", [True, False], ids=["batched transfer", "fallback"])
@pytest.mark.parametrize(("name", "sharding"), _shardings(), ids=[n for n, _ in _shardings()])
@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.bool_, jax.numpy.bfloat16])
def test_arrays_from_host_boxes_are_make_array_from_callbacks(
    monkeypatch, direct: bool, name: str, sharding: jax.sharding.Sharding, dtype: type
) -> None:
    if direct and jax_transfer._DIRECT is None:
        pytest.skip("this JAX has no batched transfer as relied on: the fallback is the way")
    if not direct:
        monkeypatch.setattr(jax_transfer, "_DIRECT", None)
    whole = (np.arange(8 * 6).reshape(8, 6) % 7).astype(dtype)
    boxes, hosts = _boxes_and_hosts(whole, sharding)
    got = jax_transfer.array_from_host_boxes(whole.shape, sharding, boxes, hosts)
    want = jax.make_array_from_callback(whole.shape, sharding, lambda idx: whole[idx])
    _same_array(got, want)


def test_a_dtype_jax_would_convert_goes_through_make_array_from_callback() -> None:
    """float64 without x64: JAX converts the host values to float32, and so does the restore."""
    if jax.config.jax_enable_x64:
        pytest.skip("x64 is on: float64 is canonical")
    sharding = SingleDeviceSharding(jax.devices()[0])
    whole = np.linspace(0, 1, 12).reshape(3, 4)
    boxes, hosts = _boxes_and_hosts(whole, sharding)
    got = jax_transfer.array_from_host_boxes(whole.shape, sharding, boxes, hosts)
    want = jax.make_array_from_callback(whole.shape, sharding, lambda idx: whole[idx])
    _same_array(got, want)
    assert got.dtype == np.float32


def test_a_scalar_array() -> None:
    sharding = SingleDeviceSharding(jax.devices()[0])
    whole = np.array(3.5, np.float32)
    boxes, hosts = _boxes_and_hosts(whole, sharding)
    got = jax_transfer.array_from_host_boxes((), sharding, boxes, hosts)
    _same_array(got, jax.make_array_from_callback((), sharding, lambda idx: whole[idx]))
