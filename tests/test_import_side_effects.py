"""Importing a jfleet module changes no global state (issue 41).

A notebook or a test imports helpers as it goes: ``from jfleet.testing import
state_as_numpy`` after training. Each child here starts a run (through ``to_distributed``,
or through ``fleet.init`` and ``distributed_model``), takes a step, then imports every
public module, the alias paths and every other module of the package one by one. After
each import the run, its optimizer, the RNG tracker's streams, the loggers' handlers and
levels, the environment and JAX's config must be as before, and the steps after the named
public modules give the losses of the same run with no import between (bit for bit: the
same program on the same data).
"""

from __future__ import annotations

import json

import pytest

from tests.subprocess_util import run_python

#: The public modules the issue names, and alias paths (``jfleet.distributed`` is Paddle's).
NAMED = (
    "jfleet.fleet",
    "jfleet.distributed",
    "jfleet.testing",
    "jfleet.checkpoint",
    "jfleet.launch",
    "jfleet.auto_parallel.search.cluster_plan",
    "jfleet.distributed.sharding",
    "jfleet.engine",
    "jfleet.inference",
    "jfleet.watchdog",
    "jfleet.consistency",
)

CHILD = """
import importlib, json, logging, os, pathlib, sys
import jax, optax
import jfleet
from jfleet.mesh import context
from jfleet.parallel.random import get_rng_state_tracker
from jfleet.models import TinyLM, lm_batches, lm_loss
from jfleet import make_train_step

MODE, NAMED = {mode!r}, {named!r}
BATCHES = lm_batches(len(NAMED) + 2)


def start():
    if MODE == "to_distributed":
        from jfleet.auto_parallel import to_distributed
        model, opt, loader = to_distributed(TinyLM(), optax.sgd(0.1), BATCHES)
        step = make_train_step(lm_loss)
        return (lambda batch: float(step(model, opt, batch))), list(loader)
    from jfleet import fleet
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {{"dp_degree": 2, "mp_degree": 4}}
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    model = fleet.distributed_model(TinyLM())
    opt = fleet.distributed_optimizer(optax.sgd(0.1))
    return (lambda batch: float(model.train_batch(batch, opt, loss_fn=lm_loss))), BATCHES


def snapshot():
    run = context.current()
    tracked = get_rng_state_tracker().get_states_tracker()
    streams = {{k: (v.seeds, v.draws) for k, v in tracked.items()}}
    # the root's handlers are left out: absl adds its own when first imported (Orbax,
    # under jfleet.checkpoint, imports it), and jfleet's log.py already copes with that
    jfleet_log = logging.getLogger("jfleet")
    logs = (logging.getLogger().level, jfleet_log.level, jfleet_log.propagate,
            [id(h) for h in jfleet_log.handlers])
    return run, None if run is None else run.optimizer, streams, logs, dict(os.environ), dict(
        jax.config.values
    )


def differs(before, after):
    if any(a is not b for a, b in zip(before[:2], after[:2])):
        return "the run or its optimizer"
    for what, a, b in zip(("RNG streams", "loggers", "environment"), before[2:5], after[2:5]):
        if a != b:
            return what
    changed = [k for k, v in before[5].items() if after[5].get(k, v) != v]
    return f"JAX config {{changed}}" if changed else None


# the same run with no import between its steps: the reference losses
step, batches = start()
reference = [step(b) for b in batches]

step, batches = start()
get_rng_state_tracker().add("import_check", 1234)  # a stream a reset would drop
already = sorted(m for m in NAMED if m in sys.modules)
losses, changed = [step(batches[0])], []
root = pathlib.Path(jfleet.__file__).parent  # listed from the files: walking would import
every = [
    ".".join(("jfleet", *f.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
    for f in sorted(root.rglob("*.py"))
    if f.stem != "__main__"  # running the launcher is not importing it
]
for name in [*NAMED, *sorted(set(every) - set(NAMED))]:
    before = snapshot()
    importlib.import_module(name)
    what = differs(before, snapshot())
    if what:
        changed.append(f"{{name}}: {{what}}")
    if name in NAMED:
        losses.append(step(batches[len(losses)]))
losses.append(step(batches[len(losses)]))
print("RESULT", json.dumps({{"reference": reference, "losses": losses, "changed": changed,
                             "already": already, "walked": len(every)}}))
"""


@pytest.mark.parametrize("mode", ["to_distributed", "fleet"])
def test_importing_any_module_after_a_run_started_leaves_the_run_and_its_streams(mode):
    code = CHILD.format(mode=mode, named=NAMED)
    out = run_python(code, env={"JFLEET_CPU_DEVICES": "8"}, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert result["changed"] == []
    assert result["losses"] == result["reference"]  # the same program, the same data
    assert result["walked"] > 100  # every module of the package was imported
    if mode == "to_distributed":  # the facade was first imported after the run started
        assert "jfleet.fleet" not in result["already"], result["already"]
