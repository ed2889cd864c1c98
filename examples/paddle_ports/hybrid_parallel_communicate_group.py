# Port of Paddle's test/collective/fleet/hybrid_parallel_communicate_group.py
# (PaddlePaddle/Paddle at commit 3160ca434da0d1d49d288f6bd077a7b074300d8c), which Paddle
# runs on 2 GPUs (dp 2); run it with `python launch.py --devices 2 <this>`.
# Framework swap: paddle tensors -> jax arrays, which cannot change in place, so each
# collective returns its result (`x = dist.all_reduce(x)`). A Paddle rank's tensor is what
# the rank's device holds; a result that differs between ranks keeps its layout with each
# device holding its rank's, and the host reads its own (rank 0's). No other line changed.
# ruff: noqa: F841

import jax.numpy as jnp
import numpy as np

import jfleet.distributed as dist
from jfleet import fleet


class TestNewGroupAPI:
    def __init__(self):
        dist.init_parallel_env()
        topo = fleet.CommunicateTopology(["data", "model", "sharding", "pipe"], [2, 1, 1, 1])
        self.hcg = fleet.HybridCommunicateGroup(topo)

        d1 = np.array([1, 2, 3])
        d2 = np.array([2, 3, 4])
        self.tensor1 = jnp.asarray(d1)
        self.tensor2 = jnp.asarray(d2)

    def test_all(self):
        topo = self.hcg.topology()
        global_rank = self.hcg.get_data_parallel_rank()

        dp_rank = self.hcg.get_data_parallel_rank()
        dp_gp = self.hcg.get_data_parallel_group()
        dp_world_size = self.hcg.get_data_parallel_world_size()
        dp_src_rank = self.hcg.get_data_parallel_group_src_rank()
        np.testing.assert_array_equal(dp_world_size, 2)
        np.testing.assert_array_equal(dp_src_rank, 0)

        mp_rank = self.hcg.get_model_parallel_rank()
        mp_gp = self.hcg.get_model_parallel_group()
        mp_world_size = self.hcg.get_model_parallel_world_size()
        mp_src_rank = self.hcg.get_model_parallel_group_src_rank()
        np.testing.assert_array_equal(mp_world_size, 1)

        tmp = np.array([0, 0, 0])
        result = jnp.asarray(tmp)
        result = dist.scatter(
            result,
            [self.tensor2, self.tensor1],
            src=dp_src_rank,
            group=dp_gp,
            sync_op=True,
        )
        if dp_rank == 0:
            np.testing.assert_array_equal(result, self.tensor2)
        elif dp_rank == 1:
            np.testing.assert_array_equal(result, self.tensor1)
        print("test scatter api ok")

        result = dist.broadcast(result, src=1, group=dp_gp, sync_op=True)
        np.testing.assert_array_equal(result, self.tensor1)
        print("test broadcast api ok")

        result = dist.reduce(result, dst=dp_src_rank, group=dp_gp, sync_op=True)
        if dp_rank == 0:
            np.testing.assert_array_equal(result, jnp.add(self.tensor1, self.tensor1))
        elif dp_rank == 1:
            np.testing.assert_array_equal(result, self.tensor1)
        print("test reduce api ok")

        result = dist.all_reduce(result, sync_op=True)
        np.testing.assert_array_equal(
            result,
            jnp.add(jnp.add(self.tensor1, self.tensor1), self.tensor1),
        )
        print("test all_reduce api ok")

        dist.wait(result, dp_gp, use_calc_stream=True)
        dist.wait(result, dp_gp, use_calc_stream=False)
        print("test wait api ok")

        result = []
        dist.all_gather(result, self.tensor1, group=dp_gp, sync_op=True)
        np.testing.assert_array_equal(result[0], self.tensor1)
        np.testing.assert_array_equal(result[1], self.tensor1)
        print("test all_gather api ok")

        dist.barrier(group=dp_gp)
        print("test barrier api ok")

        return


if __name__ == "__main__":
    gpt = TestNewGroupAPI()
    gpt.test_all()
