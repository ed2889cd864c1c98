# Port of Paddle's test/collective/fleet/dygraph_group_sharded_api_eager.py
# (PaddlePaddle/Paddle at commit 9f92b4299e160eed93e0452f7649f6d209cc89df), which Paddle
# runs on 2 GPUs (ZeRO over both); run it with `python launch.py --devices 2 <this>`.
# Framework swap: paddle tensors -> jax arrays, paddle.nn.Layer -> nnx.Module (forward ->
# __call__, rngs=), the forward + avg_loss.backward() + optimizer.step() -> one compiled
# optimizer.minimize(loss_fn, model, batch) (scaler.minimize with the GradScaler),
# paddle.optimizer.Momentum -> optax.sgd with momentum in paddle_swap.Optimizer (grad_clip
# and weight_decay chained before it, multi_precision -> fp32 master weights), paddle.amp
# -> jfleet.amp, paddle.io / seed / state_dict / cross_entropy -> paddle_swap.
# Other changed lines end in "# PORT:".
# ruff: noqa: B007, F841

import tempfile

import jax.numpy as jnp
import numpy as np
import optax
import paddle_swap
from flax import nnx
from flax.nnx import Linear

import jfleet.distributed as dist
from jfleet import amp
from jfleet.distributed.sharding import (
    group_sharded_parallel,
    save_group_sharded_model,
)
from jfleet.optim import clip_by_global_norm

epoch = 1  # PORT: 10 epochs of 20 steps take minutes on emulated CPU devices
paddle_swap.seed(2022)
np.random.seed(2022)
base_lr = 0.1
momentum_rate = 0.9
l2_decay = 1e-4
batch_size = 100


class MLP(nnx.Module):
    def __init__(self, linear_size=1000, param_attr=None, bias_attr=None):
        super().__init__()

        self._linear1 = Linear(linear_size, linear_size, rngs=paddle_swap.rngs())
        self._linear2 = Linear(linear_size, linear_size, rngs=paddle_swap.rngs())
        self._linear3 = Linear(linear_size, 10, rngs=paddle_swap.rngs())

    def __call__(self, inputs):
        y = self._linear1(inputs)
        y = self._linear2(y)
        y = self._linear3(y)
        return y


class RandomDataset(paddle_swap.Dataset):
    def __init__(self, num_samples=2000, linear_size=1000):
        self.num_samples = num_samples
        self.linear_size = linear_size

    def __getitem__(self, idx):
        img = np.random.rand(self.linear_size).astype("float32")
        label = np.ones(1).astype("int64")
        return img, label

    def __len__(self):
        return self.num_samples


def optimizer_setting(model, use_multi_precision, opt_group=False):
    clip = clip_by_global_norm(1.0)
    optimizer = paddle_swap.Optimizer(
        lambda learning_rate: optax.chain(
            clip, optax.add_decayed_weights(0.00001), optax.sgd(learning_rate, momentum=0.9)
        ),
        parameters=model,
        learning_rate=0.001,
        multi_precision=use_multi_precision,
    )

    return optimizer


def train_mlp(
    model,
    shard_level,
    use_multi_precision,
    output_dir,
    amp_level="O1",
    sync_buffers=False,
    dp_group=None,
):
    optimizer = optimizer_setting(model=model, use_multi_precision=use_multi_precision)
    model = amp.decorate(models=model, level=amp_level, save_dtype="float32")
    scaler = amp.GradScaler(init_loss_scaling=32768)

    model, optimizer, scaler = group_sharded_parallel(
        model=model,
        optimizer=optimizer,
        level=shard_level,
        scaler=scaler,
        sync_buffers=sync_buffers,
        dp_group=dp_group,
    )

    # just for test_coverage.
    if shard_level == "os_g":
        optimizer.set_lr(optimizer.get_lr())

    paddle_swap.seed(2023)
    np.random.seed(2023)
    train_loader = paddle_swap.DataLoader(
        RandomDataset(),
        batch_size=batch_size,
        shuffle=False,
        drop_last=True,
        num_workers=0,
    )

    def loss_fn(model, data):
        img, label = data
        with amp.auto_cast(model, True, level=amp_level):  # PORT: auto_cast names the model
            out = model(img)
            loss = paddle_swap.cross_entropy(input=out, label=label)
        avg_loss = jnp.mean(loss.astype(jnp.float32))
        return avg_loss

    for eop in range(epoch):
        model.train()
        for batch_id, data in enumerate(train_loader()):
            img, label = data

            if not use_multi_precision:
                avg_loss = optimizer.minimize(loss_fn, model, (img, label))
            else:
                avg_loss = scaler.minimize(optimizer, loss_fn, model, (img, label))
                scaler.update()

            optimizer.clear_grad()

    save_group_sharded_model(model, output=output_dir, optimizer=optimizer)
    return paddle_swap.parameters(model)


def test_sharding_api():
    dist.init_parallel_env()
    mlp, mlp1, mlp2 = MLP(), MLP(), MLP()
    state_dict = paddle_swap.state_dict(mlp)
    paddle_swap.set_state_dict(mlp1, state_dict)
    paddle_swap.set_state_dict(mlp2, state_dict)

    output_dir = tempfile.mkdtemp()

    # fp16
    stage2_params = train_mlp(
        mlp1,
        shard_level="os_g",
        use_multi_precision=True,
        output_dir=output_dir,
        amp_level="O2",
    )
    stage3_params = train_mlp(
        mlp2,
        shard_level="p_g_os",
        use_multi_precision=True,
        output_dir=output_dir,
        amp_level="O2",
    )

    for i in range(len(stage3_params)):
        np.testing.assert_allclose(
            paddle_swap.numpy(stage2_params[i]),
            paddle_swap.numpy(stage3_params[i]),
            rtol=1e-4,
            atol=1e-3,
        )

    # AMP
    mlp3, mlp4 = MLP(), MLP()
    paddle_swap.set_state_dict(mlp3, state_dict)
    paddle_swap.set_state_dict(mlp4, state_dict)

    stage2_params = train_mlp(
        mlp3,
        shard_level="os_g",
        use_multi_precision=True,
        output_dir=output_dir,
        amp_level="O1",
    )
    stage3_params = train_mlp(
        mlp4,
        shard_level="p_g_os",
        use_multi_precision=True,
        output_dir=output_dir,
        amp_level="O1",
    )


if __name__ == "__main__":
    test_sharding_api()
