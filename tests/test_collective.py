"""Tests for jfleet/mesh/collective.py: single-process semantics and one real 2-process job."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jfleet.mesh.collective import all_gather, all_reduce, barrier, broadcast_one_to_all
from tests.subprocess_util import paddle_launch_envs, run_many


@pytest.mark.parametrize(
    ("mode", "expected", "kind"),
    [("sum", 3, int), ("max", 3, int), ("min", 3, int), ("mean", 3.0, float)],
)
def test_all_reduce_python_int(mode, expected, kind):
    out = all_reduce(3, mode)
    assert out == expected and type(out) is kind


def test_all_reduce_python_float_and_arrays():
    assert all_reduce(0.1) == 0.1 and type(all_reduce(0.1)) is float
    out = all_reduce(np.arange(4, dtype=np.float64), "mean")
    assert isinstance(out, np.ndarray) and out.dtype == np.float64
    np.testing.assert_array_equal(out, np.arange(4))
    out = all_reduce(jnp.ones((2, 3), jnp.int32), "max")
    assert isinstance(out, np.ndarray) and out.dtype == np.int32 and out.shape == (2, 3)
    out = all_reduce(np.float32(2.5))
    assert isinstance(out, np.float32) and out == 2.5


def test_all_reduce_bad_mode():
    with pytest.raises(ValueError, match="mode='prod'"):
        all_reduce(1, "prod")


def test_all_reduce_bad_value():
    with pytest.raises(TypeError, match="str 'x'"):
        all_reduce("x")


def test_global_array_is_rejected_only_when_not_addressable():
    # Single process: every array is fully addressable, so a sharded one is fine.
    mesh = jax.make_mesh((8,), ("dp",))
    x = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, jax.P("dp")))
    np.testing.assert_array_equal(all_reduce(x, "sum"), np.arange(8.0))


def test_all_gather_and_broadcast_and_barrier():
    assert all_gather(7) == [7]
    (arr,) = all_gather(np.array([1, 2]))
    np.testing.assert_array_equal(arr, [1, 2])
    assert broadcast_one_to_all(42) == 42
    with pytest.raises(ValueError, match="src=1"):
        broadcast_one_to_all(1, src=1)
    assert barrier() is None


CHILD = """
import jax
jax.config.update("jax_num_cpu_devices", 4)
import numpy as np
from jfleet.mesh.collective import all_gather, all_reduce, barrier, broadcast_one_to_all
from jfleet.runtime.role_maker import PaddleCloudRoleMaker
from jfleet.runtime.startup import initialize_distributed

rm = PaddleCloudRoleMaker()
rank = rm.worker_index()
assert initialize_distributed(rm) is True
assert initialize_distributed(rm) is False  # already initialised, consistent
assert len(jax.devices()) == 8 and len(jax.local_devices()) == 4
assert jax.process_index() == rank and jax.process_count() == 2

assert all_reduce(1) == 2 and type(all_reduce(1)) is int
assert all_reduce(0.1 * (rank + 1)) == 0.1 + 0.2  # float64 travels exactly
out = all_reduce(np.array([rank]), "max")
assert isinstance(out, np.ndarray) and out.tolist() == [1], out
assert all_reduce(np.array([rank, 5 - rank]), "min").tolist() == [0, 4]
assert all_reduce(rank, "mean") == 0.5
assert all_gather(rank) == [0, 1]
shapes = [a.shape for a in all_gather(np.zeros(rank + 1))]
assert shapes == [(1,), (2,)], shapes
assert broadcast_one_to_all(100 + rank) == 100
try:
    all_reduce(np.zeros(rank + 1))
except ValueError as e:
    assert "same shape" in str(e)
else:
    raise AssertionError("mismatched shapes were accepted")
barrier()
barrier("second")

# Group collectives on global arrays across the two processes (dp2 x mp4: the dp groups
# span both processes, each mp group lies in one). Each process holds its own tensor.
import jax.numpy as jnp
from jfleet.mesh.collective import broadcast, reduce
from jfleet.mesh.hybrid_group import build_hybrid_communicate_group

hcg = build_hybrid_communicate_group({"dp_degree": 2, "mp_degree": 4})
assert hcg.global_rank == 4 * rank, hcg.global_rank
dp, mp = hcg.get_data_parallel_group(), hcg.get_model_parallel_group()
x = jnp.asarray([rank + 1.0])
mine = lambda y: np.asarray(y.addressable_data(0)).tolist()
assert mine(all_reduce(x, group=dp)) == [3.0], mine(all_reduce(x, group=dp))
assert mine(all_reduce(x, group=mp)) == [4.0 * (rank + 1)]
assert mine(broadcast(x, src=4, group=dp)) == [2.0]
assert mine(reduce(x, dst=0, group=dp)) == [3.0 if rank == 0 else 2.0]
barrier(dp)
print("CHILD_OK", rank)
"""


def test_two_processes_four_devices_each():
    envs = paddle_launch_envs(2, init_timeout=30, heartbeat=10)
    results = run_many([CHILD, CHILD], envs=envs, timeout=120)
    for rank, result in enumerate(results):
        assert result.returncode == 0, (
            f"child {rank} rc={result.returncode}\n{result.stdout}\n{result.stderr[-4000:]}"
        )
        assert f"CHILD_OK {rank}" in result.stdout
