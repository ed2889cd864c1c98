"""strategy.localsgd / adaptive_localsgd: replicas step on their own parameters, average every k."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jfleet import fleet, make_train_step
from jfleet.checkpoint import CheckpointManager
from jfleet.models import TinyLM, lm_batches, lm_loss
from jfleet.optim import hyperparams
from jfleet.optim.compiler import compile_strategy
from jfleet.testing import assert_trees_close, make_strategy, train_one_device

FP32 = dict(rtol=1e-5, atol=1e-6)
MOMENTUM = lambda: optax.sgd(0.5, momentum=0.9)  # noqa: E731


def _fleet(hybrid, **settings):
    fleet._reset()
    fleet.init(is_collective=True, strategy=make_strategy(hybrid, **settings), log_level="WARNING")


def _rows(opt) -> list:
    """The replicas' own parameters, as a list of leaves with a leading replica axis."""
    return [np.asarray(x) for x in jax.tree.leaves(nnx.as_pure(opt.local_state.params))]


def test_k1_equals_data_parallel_on_one_device():
    """k_steps=1: the replicas average after every step; with momentum SGD (linear in the
    gradients) that is data parallelism exactly."""
    batches = lm_batches(4)
    want_losses, want = train_one_device(TinyLM(), MOMENTUM(), batches, lm_loss)
    _fleet({"dp_degree": 8}, localsgd=True)
    model = fleet.distributed_model(TinyLM())
    opt = fleet.distributed_optimizer(MOMENTUM())
    losses = [float(model.train_batch(b, opt, loss_fn=lm_loss)) for b in batches]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_trees_close(nnx.state(model.module, nnx.Param), want, **FP32)
    assert opt.applied_meta_list == ("LocalSGDOptimizer",)
    # the momentum is each replica's own: a leading replica dimension over the data axes
    assert all(opt.replica_leaves)
    fleet._reset()


def _reference_replicas(batches, replicas, k_steps, begin_step):
    """LocalSGD written out on one device: ``replicas`` copies, each with its own momentum
    on its rows of every batch; averaged after steps <= begin_step, then every k steps."""
    graphdef, params = nnx.split(TinyLM(), nnx.Param)
    tx = MOMENTUM()

    @jax.jit
    def local_step(p, s, b):
        g = jax.grad(lambda p: lm_loss(nnx.merge(graphdef, p), b))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    ps = [params] * replicas
    ss = [tx.init(params)] * replicas
    last, history = begin_step, []
    for t, batch in enumerate(batches, 1):
        shards = [{k: v.reshape(replicas, -1, *v.shape[1:])[i] for k, v in batch.items()}
                  for i in range(replicas)]  # fmt: skip
        stepped = [local_step(p, s, b) for p, s, b in zip(ps, ss, shards, strict=True)]
        ps, ss = [p for p, _ in stepped], [s for _, s in stepped]
        due = (t - last == k_steps) if t > begin_step else True
        if due:
            last = t
            mean = jax.tree.map(lambda *xs: sum(xs) / replicas, *ps)
            ps = [mean] * replicas
        leaves = [jax.tree.leaves(p) for p in ps]
        history.append((due, [np.stack(x) for x in zip(*leaves, strict=True)]))
    return history


def test_k4_replicas_drift_between_averages_and_agree_after_each():
    batches = lm_batches(6)
    want = _reference_replicas(batches, replicas=8, k_steps=4, begin_step=1)
    _fleet({"dp_degree": 8}, localsgd=True, localsgd_configs={"k_steps": 4, "begin_step": 1})
    model = fleet.distributed_model(TinyLM())
    opt = fleet.distributed_optimizer(MOMENTUM())
    step = make_train_step(lm_loss)
    syncs = []
    for batch, (due, want_rows) in zip(batches, want, strict=True):
        step(model.module, opt, batch)
        rows = _rows(opt)
        assert_trees_close(rows, want_rows, rtol=1e-4, atol=1e-5)
        spread = max(float(np.max(np.abs(x - x[:1]))) for x in rows)
        if due:  # all replicas equal, and the model holds their average
            assert spread == 0.0
            model_params = jax.tree.leaves(nnx.state(model.module, nnx.Param))
            for x, m in zip(rows, model_params, strict=True):
                np.testing.assert_array_equal(x[0], np.asarray(m))
        else:
            assert spread > 1e-3  # each replica followed its own shard
        syncs.append(due)
    assert syncs == [True, False, False, False, True, False]
    assert int(opt.local_state.last_sync[...]) == 5
    fleet._reset()


def _adaptive_reference(script, init_k, begin_step):
    """Paddle's adaptive LocalSGD interval, step by step, from (loss, lr) pairs."""
    last, k, out = 0, init_k, []
    for t, (loss, lr) in enumerate(script, 1):
        if t == 1:
            loss0, lr0 = loss, lr
        due = (t - last == k) if t > begin_step else True
        if due:
            last = t
            if t > begin_step:
                k = min(16, max(1, math.ceil(math.sqrt(lr0 * loss / (lr * loss0) * init_k))))
        out.append(k)
    return out


def test_adaptive_k_follows_paddles_formula_on_a_scripted_loss():
    # losses and learning rates chosen so k rises, falls and hits both clamps
    losses = [2.0, 2.0, 8.0, 3.0, 0.5, 0.01, 9.0, 50.0, 50.0, 400.0, 400.0, 800.0, 1.0]
    lrs = [0.1] * 4 + [0.05] * 9
    script = list(zip(losses, lrs, strict=True))
    want = _adaptive_reference(script, init_k=2, begin_step=2)
    assert len(set(want)) >= 4 and 1 in want and 16 in want  # the script exercises the rule

    _fleet({"dp_degree": 8}, adaptive_localsgd=True,
           adaptive_localsgd_configs={"init_k_steps": 2, "begin_step": 2})  # fmt: skip
    model = fleet.distributed_model(nnx.Linear(2, 2, rngs=nnx.Rngs(0))).module
    opt = fleet.distributed_optimizer(hyperparams.sgd(0.1))

    def scripted(m, b):  # the scripted loss, plus a term so the model has gradients
        return jnp.mean(b["loss"]) + 1e-3 * jnp.mean(m(b["x"]) ** 2)

    step = make_train_step(scripted)
    got = []
    for loss, lr in script:
        opt.set_lr(lr)
        step(model, opt, {"x": np.ones((16, 2), np.float32), "loss": np.full(16, loss, np.float32)})
        got.append(int(opt.local_state.k_steps[...]))
    assert opt.applied_meta_list == ("AdaptiveLocalSGDOptimizer",)
    assert got == want
    fleet._reset()


def test_checkpoint_resumes_mid_interval_exactly(tmp_path):
    """Saved between averages (replicas apart), restored into fresh objects: the run goes on
    as if never stopped (the replicas' parameters and momenta are in the optimizer's state)."""
    batches = lm_batches(5)
    _fleet({"dp_degree": 4, "mp_degree": 2}, localsgd=True,
           localsgd_configs={"k_steps": 3, "begin_step": 1})  # fmt: skip
    step = make_train_step(lm_loss)
    model, opt = fleet.distributed_model(TinyLM()).module, fleet.distributed_optimizer(MOMENTUM())
    for b in batches[:2]:
        step(model, opt, b)
    with CheckpointManager(tmp_path, async_save=False) as mngr:
        mngr.save(2, model, opt)
        straight = [float(step(model, opt, b)) for b in batches[2:]]
        fresh = fleet.distributed_model(TinyLM(seed=1)).module
        fresh_opt = fleet.distributed_optimizer(MOMENTUM()).init(fresh)
        mngr.restore(model=fresh, optimizer=fresh_opt)
    resumed = [float(step(fresh, fresh_opt, b)) for b in batches[2:]]
    np.testing.assert_allclose(resumed, straight, rtol=1e-6)
    assert_trees_close(_rows(fresh_opt), _rows(opt), rtol=1e-6, atol=1e-7)
    fleet._reset()


@pytest.mark.parametrize(
    "first, second",
    [
        ("localsgd", "adaptive_localsgd"),
        ("localsgd", "amp"),  # fp16 AMP: a loss scale per replica
        ("adaptive_localsgd", "fp16_allreduce"),  # no gradient is all-reduced
        ("localsgd", "sharding"),  # ZeRO would split the per-replica state
    ],
)
def test_forbidden_combinations_name_both_switches(first, second):
    match = rf"strategy\.{first}=True.*strategy\.{second}=True"
    settings = {first: True, second: True}
    with pytest.raises(ValueError, match=match):
        compile_strategy(optax.sgd(0.1), make_strategy(**settings))


def test_bf16_amp_is_allowed_and_opt_update_outside_the_engine_is_refused():
    bf16 = make_strategy(localsgd=True, amp=True, amp_configs={"dtype": "bfloat16"})
    assert compile_strategy(optax.sgd(0.1), bf16).applied_meta_list == (
        "LocalSGDOptimizer",
        "AMPOptimizer",
    )
    _fleet({"dp_degree": 8}, localsgd=True)
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    opt = fleet.distributed_optimizer(optax.sgd(0.1)).init(model)
    grads = nnx.state(model, nnx.Param)
    with pytest.raises(RuntimeError, match=r"strategy\.localsgd=True.*train_batch"):
        opt.update(model, grads)
    fleet._reset()
