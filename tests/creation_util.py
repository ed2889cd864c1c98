"""Checks shared by the sharded-creation tests: what a creation program keeps per device,
and the one-device construction the created values must equal."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax
import numpy as np
from flax import nnx

from jfleet.checkpoint.layout import logical_leaves
from jfleet.mesh import create


@contextlib.contextmanager
def creation_programs(monkeypatch) -> Iterator[list]:
    """Collects the compiled memory analysis of every creation program run inside."""
    seen: list = []
    program = create._program

    def measured(fn, out_shardings):
        compiled = program(fn, out_shardings)
        seen.append(compiled.memory_analysis())
        return compiled

    monkeypatch.setattr(create, "_program", measured)
    try:
        yield seen
    finally:
        monkeypatch.undo()
    assert seen, "the model was created without a creation program"


def compiled_on_one_device(factory: Callable[[], nnx.Module]) -> nnx.Module:
    """``factory`` compiled as one program on one device: the values to equal bitwise."""
    graphdef, _ = nnx.split(nnx.eval_shape(factory))
    state = _one_device_program(factory)()
    return nnx.merge(graphdef, state)


def _one_device_program(factory: Callable[[], nnx.Module]) -> jax.stages.Compiled:
    """The construction as one program on one device (no layouts the model carries)."""

    def state() -> nnx.State:
        with nnx.use_eager_sharding(False):
            return nnx.state(factory())

    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.jit(state, out_shardings=one).lower().compile()


def values(model: nnx.Module) -> dict[str, np.ndarray]:
    """Every parameter under its plain (per-layer) path, gathered to the host."""
    return {k: np.asarray(v) for k, v in logical_leaves(model, model).items()}


def _peak(memory) -> int:
    return memory.output_size_in_bytes + memory.temp_size_in_bytes


def assert_created_in_shards(
    model: nnx.Module, programs: list, factory: Callable[[], nnx.Module]
) -> None:
    """Every creation program keeps, per device, memory in proportion to the shards it
    makes: its peak (outputs + scratch) over its outputs is at most 1.3 x the one-device
    construction's (the initialisers' scratch, ~3 x a tensor for threefry's bits). A
    pipelined stack whose blocks every device computed measured 1.8 x; a whole copy of a
    split parameter adds itself and its scratch. And no array the model holds is whole
    on a device: each device's buffer is its shard's shape."""
    whole = _one_device_program(factory)
    ratio = _peak(whole.memory_analysis()) / whole.memory_analysis().output_size_in_bytes
    for memory in programs:
        assert _peak(memory) <= 1.3 * ratio * memory.output_size_in_bytes, (
            f"a creation program peaks at {_peak(memory)} B per device for "
            f"{memory.output_size_in_bytes} B of shards; the one-device construction's "
            f"peak is {ratio:.2f} x its outputs"
        )
    params = nnx.to_flat_state(nnx.state(model, nnx.Param))
    split = [p for p, v in params if v.get_value().sharding.shard_shape(v.shape) != v.shape]
    assert split, "the layout splits no parameter; nothing is checked"
    for path, var in params:
        want = var.get_value().sharding.shard_shape(var.shape)
        assert all(s.data.shape == want for s in var.get_value().addressable_shards), path
