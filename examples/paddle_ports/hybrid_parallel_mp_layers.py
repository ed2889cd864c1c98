# Port of Paddle's test/collective/fleet/hybrid_parallel_mp_layers.py
# (PaddlePaddle/Paddle at commit 0ab6998c22c7f4ea942b2437353f34c257e868d6), which Paddle
# runs on 2 GPUs (mp 2); run it with `python examples/paddle_ports/launch.py --devices 2 <this>`.
# Framework swap: paddle tensors -> jax arrays, paddle.nn.Layer -> nnx.Module (forward ->
# __call__, rngs=, Flax parameter names: kernel / embedding), loss.backward() +
# optimizer.step() -> nnx.value_and_grad + optax via nnx.Optimizer, paddle.seed / randn /
# parameters / set_value -> paddle_swap. A Paddle rank's tensor is the piece of a global
# array that the rank's device holds; the host is rank 0, and reads its pieces with
# paddle_swap.local. Other changed lines end in "# PORT:".
# ruff: noqa: B007, F841

import random
import unittest

import jax
import jax.numpy as jnp
import numpy as np
import optax
import paddle_swap
from flax import nnx

import jfleet.distributed as dist
from jfleet import fleet


def set_random_seed(seed):
    """Set random seed for reproducibility."""
    random.seed(seed)
    np.random.seed(seed)
    paddle_swap.seed(seed)
    fleet.meta_parallel.model_parallel_random_seed(seed)


class ColumnLinearNet(nnx.Module):
    def __init__(self, input_size, output_size, global_dtype):
        super().__init__()
        self.parallel_linear = fleet.meta_parallel.ColumnParallelLinear(
            in_features=input_size,
            out_features=output_size,
            has_bias=True,
            gather_output=True,
            name="test_column_linear",
            rngs=paddle_swap.rngs(),
        )

    def __call__(self, x):
        output = self.parallel_linear(x)
        return output


class RowLinearNet(nnx.Module):
    def __init__(self, input_size, output_size):
        super().__init__()
        self.parallel_linear = fleet.meta_parallel.RowParallelLinear(
            in_features=input_size,
            out_features=output_size,
            has_bias=True,
            input_is_parallel=False,
            name="test_row_linear",
            rngs=paddle_swap.rngs(),
        )

    def __call__(self, x):
        output = self.parallel_linear(x)
        return output


class EmbeddingNet(nnx.Module):
    def __init__(self, vocab_size, hidden_size):
        super().__init__()
        self.embedding = fleet.meta_parallel.VocabParallelEmbedding(
            vocab_size, hidden_size, rngs=paddle_swap.rngs()
        )

    def __call__(self, x):
        output = self.embedding(x)
        return output


class SimpleMatmul(nnx.Module):
    def __init__(self, weight, output_size, global_dtype):
        super().__init__()
        self.weight = nnx.Param(jnp.asarray(weight, global_dtype))
        self.bias = nnx.Param(jnp.zeros([output_size], global_dtype))

    def __call__(self, x):
        output = jnp.matmul(x, self.weight[...]) + self.bias[...]
        return output


class SimpleEmbedding(nnx.Module):
    def __init__(self, vocab_size, hidden_size, weight):
        super().__init__()
        self.embedding = nnx.Embed(
            vocab_size,
            hidden_size,
            embedding_init=lambda *_: jnp.asarray(weight),
            rngs=paddle_swap.rngs(),
        )

    def __call__(self, x):
        output = self.embedding(x)
        return output


@nnx.jit
def _backward_step(model, optimizer, x):
    """``loss = model(x).mean(); loss.backward(); optimizer.step()``, compiled once."""
    loss, grads = nnx.value_and_grad(lambda m: m(x).mean())(model)
    optimizer.update(model, grads)
    return loss


class TestDistTraining(unittest.TestCase):
    def setUp(self):
        strategy = fleet.DistributedStrategy()
        self.model_parallel_size = 2
        strategy.hybrid_configs = {
            "dp_degree": 1,
            "mp_degree": self.model_parallel_size,
            "pp_degree": 1,
        }
        fleet.init(is_collective=True, strategy=strategy)

    def test_column_parallel_layer(self):
        set_random_seed(1024)
        global_dtype = "float32"

        input_size_per_card = 17
        input_size = input_size_per_card * self.model_parallel_size
        output_size_per_card = 13
        output_size = output_size_per_card * self.model_parallel_size
        batch_size = 4

        model_a = ColumnLinearNet(input_size, output_size, global_dtype)

        # get w
        check_group = dist.new_group(list(range(self.model_parallel_size)))
        integral_w = []
        partial_w = jnp.copy(model_a.parallel_linear.kernel[...])
        dist.all_gather(integral_w, partial_w, group=check_group)
        integral_w = jnp.concatenate([paddle_swap.local(w) for w in integral_w], axis=1)

        model_b = SimpleMatmul(integral_w, output_size, global_dtype)

        optimizer_a = nnx.Optimizer(model_a, optax.sgd(learning_rate=0.001), wrt=nnx.Param)
        optimizer_b = nnx.Optimizer(model_b, optax.sgd(learning_rate=0.001), wrt=nnx.Param)
        for idx in range(5):
            input = paddle_swap.randn([batch_size, input_size], global_dtype)

            loss_a = _backward_step(model_a, optimizer_a, input)

            loss_b = _backward_step(model_b, optimizer_b, input)

            np.testing.assert_allclose(loss_a, loss_b, rtol=5e-5)  # PORT: XLA's own sum order

    def test_row_parallel_layer(self):
        global_dtype = "float32"
        set_random_seed(1024)

        self.hcg = fleet.get_hybrid_communicate_group()

        self.word_size = self.hcg.get_model_parallel_world_size()
        self.rank_id = self.hcg.get_model_parallel_rank()

        input_size_per_card = 11
        input_size = input_size_per_card * self.model_parallel_size
        output_size_per_card = 10
        output_size = output_size_per_card * self.model_parallel_size
        batch_size = 4

        model_a = RowLinearNet(input_size, output_size)

        # get w
        check_group = dist.new_group(list(range(self.model_parallel_size)))
        integral_w = []
        partial_w = jnp.copy(model_a.parallel_linear.kernel[...])
        dist.all_gather(integral_w, partial_w, group=check_group)
        integral_w = jnp.concatenate([paddle_swap.local(w) for w in integral_w], axis=0)

        model_b = SimpleMatmul(integral_w, output_size, global_dtype)

        optimizer_a = nnx.Optimizer(model_a, optax.sgd(learning_rate=0.001), wrt=nnx.Param)

        optimizer_b = nnx.Optimizer(model_b, optax.sgd(learning_rate=0.001), wrt=nnx.Param)

        for idx in range(5):
            input = paddle_swap.randn([batch_size, input_size], global_dtype)

            loss_a = _backward_step(model_a, optimizer_a, input)

            loss_b = _backward_step(model_b, optimizer_b, input)

            np.testing.assert_allclose(np.asarray(loss_a), np.asarray(loss_b), rtol=5e-5)

    def test_parallel_embedding(self):
        batch_size = 17
        seq_length = 23
        vocab_size_per_card = 2
        vocab_size = vocab_size_per_card * self.model_parallel_size
        hidden_size = 2
        seed = 1236

        set_random_seed(seed)
        rank_id = dist.get_rank()

        # model_a
        model_a = EmbeddingNet(vocab_size, hidden_size)

        # model_b
        check_group = dist.new_group(list(range(self.model_parallel_size)))
        integral_w = []
        partial_w = jnp.copy(model_a.embedding.embedding[...])
        dist.all_gather(integral_w, partial_w, group=check_group)
        result_w = []
        for idx in range(len(integral_w)):
            tmp = jnp.take(
                paddle_swap.local(integral_w[idx]),
                jnp.asarray(list(range(vocab_size_per_card))),
                axis=0,
            )
            result_w.append(tmp)
        integral_w = jnp.concatenate(result_w, axis=0)

        model_b = SimpleEmbedding(vocab_size, hidden_size, integral_w)

        optimizer_a = nnx.Optimizer(model_a, optax.sgd(learning_rate=0.001), wrt=nnx.Param)

        optimizer_b = nnx.Optimizer(model_b, optax.sgd(learning_rate=0.001), wrt=nnx.Param)

        for _ in range(5):
            np_input_data = np.random.randint(0, vocab_size, (batch_size, seq_length))
            input_data = jnp.asarray(np_input_data, dtype="int32")

            loss_a = _backward_step(model_a, optimizer_a, input_data)

            loss_b = _backward_step(model_b, optimizer_b, input_data)
            print(np.asarray(loss_a), np.asarray(loss_b))

            np.testing.assert_allclose(np.asarray(loss_a), np.asarray(loss_b))

    def test_parallel_cross_entropy(self):
        batch_size = 8
        seq_length = 16
        class_size_per_card = 2
        vocab_size = class_size_per_card * self.model_parallel_size
        seed = 100

        set_random_seed(seed)
        rank_id = dist.get_rank()

        # model_a
        model_a = fleet.meta_parallel.ParallelCrossEntropy()

        model_b = optax.softmax_cross_entropy_with_integer_labels
        loss_and_grad_a = jax.jit(jax.value_and_grad(lambda d, y: model_a(d, y).sum() / batch_size))
        loss_and_grad_b = jax.jit(jax.value_and_grad(lambda d, y: model_b(d, y).sum() / batch_size))

        paddle_swap.seed(rank_id * 10)
        random.seed(seed)
        np.random.seed(seed)

        for _ in range(5):
            np_label = np.random.randint(0, vocab_size, (batch_size, seq_length))
            label = jnp.asarray(np_label)

            data = paddle_swap.randn([batch_size, seq_length, vocab_size], mp=-1)  # PORT: global V

            check_group = dist.new_group(list(range(self.model_parallel_size)))
            integral_data = []
            partial_data = jnp.copy(data)
            dist.all_gather(integral_data, partial_data, group=check_group)
            integral_data = jnp.concatenate([paddle_swap.local(d) for d in integral_data], axis=-1)

            loss_a, data_grad = loss_and_grad_a(data, label)
            loss_b, integral_data_grad = loss_and_grad_b(integral_data, label)
            print("loss_a: ", np.asarray(loss_a), "loss_b: ", np.asarray(loss_b))

            np.testing.assert_allclose(np.asarray(loss_a), np.asarray(loss_b), rtol=1e-6)

            integral_grad = []
            partial_grad = jax.device_put(data_grad, data.sharding)
            dist.all_gather(integral_grad, partial_grad, group=check_group)
            integral_grad = jnp.concatenate([paddle_swap.local(g) for g in integral_grad], axis=-1)

            np.testing.assert_allclose(
                np.asarray(integral_data_grad),
                np.asarray(integral_grad),
                rtol=1e-6,
            )


if __name__ == "__main__":
    unittest.main()
