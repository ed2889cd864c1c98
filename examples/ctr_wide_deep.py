"""Wide & deep click-through-rate model in parameter-server mode, on synthetic click logs.

Every instance has ``--fields`` categorical features; each feature id is 64-bit
(``field << 32 | value``), values Zipf-skewed over ``--vocab`` per field, so a full run sees
millions of distinct ids. A hidden logistic rule over hashed per-feature weights (plus one
pairwise interaction) draws the clicks, so the AUC is learnable.

The sparse side is one :class:`jfleet.ps.SparseTable` (a row per hashed id: column 0 the
wide weight, the rest the deep embedding), sharded over every device and updated sparsely
by Paddle's adagrad accessor; the dense MLP trains with optax Adam, data parallel. The
Paddle PS script shape is kept: ``fleet.init(is_collective=False)``, the server part, the
worker part, ``set_date`` / ``shrink`` per day, ``save_one_table``, ``stop_worker``.

    python examples/ctr_wide_deep.py            # millions of ids (a few minutes on CPU)
    python examples/ctr_wide_deep.py --quick    # seconds: what the tests run
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # on CPU: 8 emulated devices
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from jfleet import fleet
from jfleet.ps import CtrAccessor, SparseSGDRule, SparseTable, hash_ids
from jfleet.topology import DATA_AXES

SALT = np.uint64(0x5EED5EED5EED5EED)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small run of a few seconds")
    p.add_argument("--fields", type=int, default=16)
    p.add_argument("--vocab", type=int, default=1 << 20, help="values per field")
    p.add_argument("--rows", type=int, default=1 << 23, help="sparse table rows")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--days", type=int, default=3, help="set_date / shrink after each day")
    p.add_argument("--lr", type=float, default=0.1, help="sparse adagrad learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save_dir", default=None, help="keep the saved table there (default: none)")
    args = p.parse_args(argv)
    if args.quick:
        args.fields, args.vocab, args.rows = 8, 4_000, 1 << 18
        args.batch, args.steps, args.days = 512, 200, 2
    return args


# ------------------------------------------------------------------- the click logs
def feature_ids(rng: np.random.Generator, n: int, fields: int, vocab: int) -> np.ndarray:
    """``[n, fields]`` int64 ids: Zipf-like values per field, the field in the high bits."""
    values = np.floor(vocab * rng.random((n, fields)) ** 4).astype(np.int64)
    return (np.arange(fields, dtype=np.int64) << 32) | values


def hidden_weight(ids: np.ndarray) -> np.ndarray:
    """The rule's weight of each id: a fixed hash of it, uniform in [-1.5, 1.5]."""
    u = hash_ids(ids.view(np.uint64) ^ SALT, 1 << 24) / float(1 << 24)
    return 3.0 * u - 1.5


def click_logs(rng: np.random.Generator, n: int, args: argparse.Namespace):
    ids = feature_ids(rng, n, args.fields, args.vocab)
    w = hidden_weight(ids)
    logit = w.sum(1) / np.sqrt(args.fields) * 2.0 + 1.5 * w[:, 0] * w[:, 1] - 1.0
    clicks = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return ids, clicks


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney: the chance a click outscores a non-click)."""
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    pos = labels > 0.5
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


# ------------------------------------------------------------------------ the model
def init_dense(key: jax.Array, fields: int, dim: int) -> dict:
    k1, k2, k3 = jax.random.split(key, 3)
    d_in = fields * dim

    def dense(k: jax.Array, i: int, o: int) -> dict:
        return {"w": jax.random.normal(k, (i, o)) / np.sqrt(i), "b": jnp.zeros(o)}

    return {"h1": dense(k1, d_in, 32), "h2": dense(k2, 32, 16), "out": dense(k3, 16, 1)}


def logits(dense: dict, emb: jax.Array) -> jax.Array:
    """``emb``: ``[batch, fields, 1 + dim]``; wide = sum of column 0, deep = MLP on the rest."""
    wide = emb[..., 0].sum(-1)
    h = emb[..., 1:].reshape(emb.shape[0], -1)
    for name in ("h1", "h2"):
        h = jax.nn.relu(h @ dense[name]["w"] + dense[name]["b"])
    return wide + (h @ dense["out"]["w"] + dense["out"]["b"])[:, 0]


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    fleet.init(is_collective=False, log_level="WARNING")
    mesh = fleet.get_hybrid_communicate_group().mesh
    batch_sharding = NamedSharding(mesh, P(DATA_AXES))
    rule = SparseSGDRule("adagrad", learning_rate=args.lr, initial_range=0.01)
    table = SparseTable(args.rows, 9, CtrAccessor(rule), table_id=0, seed=args.seed)
    if fleet.is_server():  # every process: it holds a shard of every table
        fleet.init_server()
        fleet.run_server()  # returns at once; serving happens inside the step

    tx = optax.adam(3e-3)
    replicated = NamedSharding(mesh, P())
    dense = jax.device_put(init_dense(jax.random.key(args.seed), args.fields, 8), replicated)
    opt_state = jax.device_put(tx.init(dense), replicated)

    def loss_fn(dense, pulled, inverse, labels):
        z = logits(dense, pulled[inverse])
        return optax.sigmoid_binary_cross_entropy(z, labels).mean()

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def train_step(tstate, dense, opt_state, rows, inverse, show, click, labels):
        pulled = table.pull(tstate, rows)
        loss, (g_dense, g_rows) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
            dense, pulled, inverse, labels
        )
        updates, opt_state = tx.update(g_dense, opt_state, dense)
        dense = optax.apply_updates(dense, updates)
        # the accessor wants the gradient of the summed loss (Paddle scales by batch size)
        tstate = table.push(tstate, rows, g_rows * labels.shape[0], show, click)
        return tstate, dense, opt_state, loss

    @jax.jit
    def predict(tstate, dense, rows, inverse):
        return jax.nn.sigmoid(logits(dense, table.pull(tstate, rows)[inverse]))

    rng = np.random.default_rng(args.seed)
    test_ids, test_clicks = click_logs(rng, 8192, args)
    test = table.prepare(test_ids)

    def test_auc() -> float:
        p = predict(table.state, dense, test.rows, test.inverse)
        return auc(test_clicks, np.asarray(p))

    print(f"before training: test AUC {test_auc():.3f}")
    if fleet.is_worker():  # every process trains too
        fleet.init_worker()
        seen: set[int] = set()
        steps_per_day = max(1, args.steps // args.days)
        start, loss = time.time(), float("nan")
        bar = tqdm(range(args.steps), desc="ctr", unit="step", mininterval=1.0)
        for step in bar:
            ids, clicks = click_logs(rng, args.batch, args)
            if len(seen) < 5_000_000:
                seen.update(np.unique(ids).tolist())
            b = table.prepare(ids, clicks)
            inverse = jax.device_put(b.inverse, batch_sharding)
            labels = jax.device_put(clicks, batch_sharding)
            table.state, dense, opt_state, loss = train_step(
                table.state, dense, opt_state, b.rows, inverse, b.show, b.click, labels
            )
            if (step + 1) % 50 == 0:
                bar.set_postfix(loss=f"{float(loss):.4f}")
            if (step + 1) % steps_per_day == 0:  # end of a day: age, decay, evict
                fleet.set_date(0, 20250101 + (step + 1) // steps_per_day)
                evicted = fleet.shrink()[0]
                bar.write(f"day {(step + 1) // steps_per_day}: shrink evicted {evicted} rows")
        bar.close()
        print(
            f"trained {args.steps} steps of {args.batch} in {time.time() - start:.1f}s; "
            f"distinct feature ids seen: {len(seen)}{'+' if len(seen) >= 5_000_000 else ''}; "
            f"table rows in use: {table.present_rows()}; last loss {float(loss):.4f}"
        )
        with tempfile.TemporaryDirectory(prefix="ctr_table_") as tmp:
            save_dir = args.save_dir or tmp  # the temporary one is removed afterwards
            saved = fleet.save_one_table(0, save_dir, 0)
            print(f"save_one_table: {saved} rows to {save_dir}")
        fleet.stop_worker()
    final = test_auc()
    print(f"test AUC {final:.3f}")
    return final


if __name__ == "__main__":
    main()
