# Port of Paddle's test/collective/fleet/hybrid_parallel_pp_embedding.py
# (PaddlePaddle/Paddle at commit 05ac0261d5496c1315494c78ce76620d13de5b52), which Paddle
# runs on 2 GPUs (pp 2); run it with `python examples/paddle_ports/launch.py --devices 2 <this>`.
# Framework swap: paddle tensors -> jax arrays, paddle.nn.Layer -> nnx.Module (forward ->
# __call__, Flax parameter names), loss.backward() + optimizer.step() -> nnx.value_and_grad +
# optax via nnx.Optimizer, paddle.optimizer.lr -> jfleet.optim.lr, paddle.seed / parameters /
# set_value / create_parameter / softmax_with_cross_entropy -> paddle_swap. One process holds
# every stage, so the host sees all of the pipeline's parameters. Other changed lines end in
# "# PORT:".
# ruff: noqa: B007, B023, F841, RUF059

import random
import unittest

import jax.numpy as jnp
import numpy as np
import optax
import paddle_swap
from flax import nnx
from flax.nnx import Module as Layer
from flax.nnx import Sequential

import jfleet.distributed as dist
from jfleet import fleet
from jfleet.fleet.meta_parallel import PipelineLayer
from jfleet.optim import lr


def set_random_seed(seed, dp_id, rank_id):
    """Set random seed for reproducability."""
    random.seed(seed)
    np.random.seed(seed + dp_id)
    paddle_swap.seed(seed + dp_id)


batch_size = 16
micro_batch_size = 4
vocab_size = 128
hidden_size = 8


class SimpleNet(Layer):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nnx.Embed(vocab_size, hidden_size, rngs=paddle_swap.rngs())

        self.softmax_weight = paddle_swap.create_parameter(shape=[hidden_size, vocab_size])
        self.softmax_bias = paddle_swap.create_parameter(shape=[vocab_size], is_bias=False)

    def __call__(self, x1, x2, y1):
        x_emb = self.word_embeddings(x1)
        fc = jnp.matmul(x_emb, self.softmax_weight[...])
        fc = jnp.add(fc, self.softmax_bias[...])
        projection = jnp.reshape(fc, [-1, vocab_size])
        loss = paddle_swap.softmax_with_cross_entropy(logits=projection, label=y1)
        return loss.mean()


class EmbeddingNet(Layer):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nnx.Embed(vocab_size, hidden_size, rngs=paddle_swap.rngs())

    def __call__(self, args):
        x1, x2 = args
        x_emb = self.word_embeddings(x1)
        return x_emb, x2


class MatmulNet(Layer):
    def __init__(self):
        super().__init__()
        self.softmax_weight = paddle_swap.create_parameter(shape=[hidden_size, vocab_size])

    def __call__(self, args):
        x1, x2 = args
        fc = jnp.matmul(x1, self.softmax_weight[...])

        return fc, x2


class BiasNet(Layer):
    def __init__(self):
        super().__init__()
        self.softmax_bias = paddle_swap.create_parameter(shape=[vocab_size])

    def __call__(self, args):
        fc, x2 = args
        fc = jnp.add(fc, self.softmax_bias[...])
        projection = jnp.reshape(fc, [-1, vocab_size])
        return projection, x2


class LossNet(Layer):
    def __init__(self):
        super().__init__()

    def __call__(self, args, y1):
        projection, x2 = args
        loss = paddle_swap.softmax_with_cross_entropy(logits=projection, label=y1[0])
        return loss.mean()


class SimpleNetPipe(Layer):
    def __init__(self):
        super().__init__()
        self.features = Sequential(EmbeddingNet(), MatmulNet(), BiasNet())

    def to_layers(self):
        feat = [self.features.layers[i] for i in range(len(self.features.layers))]
        return feat


class TestDistEmbeddingTraning(unittest.TestCase):
    def setUp(self):
        strategy = fleet.DistributedStrategy()
        self.model_parallel_size = 1
        self.data_parallel_size = 1
        self.pipeline_parallel_size = 2
        strategy.hybrid_configs = {
            "dp_degree": self.data_parallel_size,
            "mp_degree": self.model_parallel_size,
            "pp_degree": self.pipeline_parallel_size,
        }
        strategy.pipeline_configs = {
            "accumulate_steps": batch_size // micro_batch_size,
            "micro_batch_size": micro_batch_size,
        }
        fleet.init(is_collective=True, strategy=strategy)

    def test_pp_model(self):
        hcg = fleet.get_hybrid_communicate_group()
        word_size = hcg.get_model_parallel_world_size()
        dp_id = hcg.get_data_parallel_rank()
        pp_id = hcg.get_stage_id()
        rank_id = dist.get_rank()
        set_random_seed(1024, dp_id, rank_id)

        # construct model a
        model_a = SimpleNet()
        scheduler_a = lr.PiecewiseDecay(
            boundaries=[2, 3, 4], values=[0.01, 0.02, 0.03, 0.04], verbose=True
        )
        optimizer_a = paddle_swap.Optimizer(
            optax.sgd, learning_rate=scheduler_a, parameters=model_a
        )

        init_net = SimpleNetPipe()
        model_b = PipelineLayer(
            layers=init_net.to_layers(),
            num_stages=self.pipeline_parallel_size,
            loss_fn=LossNet(),
        )

        scheduler_b = lr.PiecewiseDecay(
            boundaries=[2, 3, 4], values=[0.01, 0.02, 0.03, 0.04], verbose=True
        )
        optimizer_b = paddle_swap.Optimizer(
            optax.sgd, learning_rate=scheduler_b, parameters=model_b
        )
        model_b = fleet.distributed_model(model_b)
        optimizer_b = fleet.distributed_optimizer(optimizer_b)

        param_len = len(paddle_swap.parameters(model_a))

        parameters = []
        for param in paddle_swap.parameters(model_a):
            print(param.shape)
            parameters.append(paddle_swap.numpy(param))

        model_b_params = paddle_swap.parameters(model_b)
        if pp_id == 0:
            paddle_swap.set_value(model_b_params[0], parameters[2])
        else:
            paddle_swap.set_value(model_b_params[0], parameters[0])
            paddle_swap.set_value(model_b_params[1], parameters[1])
        paddle_swap.set_value(model_b_params[1], parameters[0])  # PORT: stage 1 is here too
        paddle_swap.set_value(model_b_params[2], parameters[1])  # PORT: stage 1 is here too

        for step in range(5):
            x1_data = np.random.randint(0, vocab_size, size=[batch_size, 1])
            x2_data = np.random.randint(0, vocab_size, size=[batch_size, 1])
            y1_data = np.random.randint(0, 10, size=[batch_size, 1])

            x1 = jnp.asarray(x1_data)
            x2 = jnp.asarray(x2_data)
            y1 = jnp.asarray(y1_data)

            loss_a, grads_a = nnx.value_and_grad(lambda m: m(x1, x2, y1))(model_a)
            optimizer_a.step(model_a, grads_a)
            optimizer_a.clear_grad()
            scheduler_a.step()

            loss_b = model_b.train_batch([(x1, x2), (y1,)], optimizer_b, scheduler_b)

            print("loss", np.asarray(loss_a), np.asarray(loss_b))
            np.testing.assert_allclose(np.asarray(loss_a), np.asarray(loss_b))


if __name__ == "__main__":
    unittest.main()
