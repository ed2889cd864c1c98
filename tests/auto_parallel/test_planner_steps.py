"""The planner's named steps: the example's printed plan pinned, each step small and usable alone.

``golden/llama_example_plan*.txt`` are the plans ``examples/llama_to_distributed.py``
prints (its model, its batch of 16 x 8 tokens, 8 CPU devices) by the default plan and by
``--mesh dp=2,pp=2,mp=2``; a change to the cost model or the planner that moves any
number or reason in them fails here. Regenerate, when a change is meant to move them, with

    JFLEET_REGENERATE_GOLDEN=1 python -m pytest tests/auto_parallel/test_planner_steps.py
"""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path

import pytest

from jfleet.auto_parallel import cost_comm, cost_memory, cost_model, planner, step_shape
from jfleet.auto_parallel.cost.layout import Layout, Workload
from jfleet.auto_parallel.match.patterns import ParamInfo, match_patterns
from jfleet.models.llama import TinyLlama

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"


def _example_model():
    spec = importlib.util.spec_from_file_location(
        "llama_to_distributed_example", ROOT / "examples" / "llama_to_distributed.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_model()


@pytest.mark.parametrize(
    ("name", "mesh"),
    [
        ("llama_example_plan.txt", None),
        ("llama_example_plan_dp2_pp2_mp2.txt", {"dp": 2, "pp": 2, "mp": 2}),
    ],
)
def test_example_plan_is_golden(name, mesh):
    plan = planner.plan_for(
        _example_model(), device_num=8, batch_size=16, seq_len=8, force_mesh=mesh
    )
    path = GOLDEN / name
    if os.environ.get("JFLEET_REGENERATE_GOLDEN"):
        path.write_text(str(plan) + "\n")
    assert str(plan) + "\n" == path.read_text()


def _function_lines(module) -> dict[str, int]:
    tree = ast.parse(Path(module.__file__).read_text())
    return {
        n.name: n.end_lineno - n.lineno + 1
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def _body_lines(module, name: str) -> int:
    """Lines of a function without its docstring."""
    tree = ast.parse(Path(module.__file__).read_text())
    (fn,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    doc = fn.body[0]
    return fn.end_lineno - fn.lineno + 1 - (doc.end_lineno - doc.lineno + 1)


def test_estimate_and_plan_for_are_short_named_steps():
    assert _body_lines(cost_model, "estimate") <= 60
    assert _body_lines(planner, "plan_for") <= 60
    for module in (cost_model, cost_comm, cost_memory, planner, step_shape):
        too_long = {n: k for n, k in _function_lines(module).items() if k > 100}
        assert not too_long, f"{module.__name__}: {too_long}"


def test_each_spec_is_computed_once_per_mp_degree(monkeypatch):
    found = match_patterns(TinyLlama(vocab=64, width=32, heads=4, layers=2))
    calls = []
    real = ParamInfo.spec_for

    def counted(self, mp):
        calls.append((self.path, mp))
        return real(self, mp)

    monkeypatch.setattr(ParamInfo, "spec_for", counted)
    work = Workload(batch_size=16, seq_len=8, sequence_parallel=True)
    layouts = [
        Layout(dp=2, mp=4),
        Layout(sharding=2, mp=4, zero_stage=3),
        Layout(pp=2, mp=2, dp=2, num_microbatches=2, schedule="1F1B"),
        Layout(pp=2, mp=2, dp=2, num_microbatches=4, schedule="FThenB", recompute=True),
    ]
    for lay in layouts:
        cost_model.estimate(found, work, lay, "cpu", devices_per_node=8)
    expected = [(p.path, mp) for mp in (4, 2) for p in found.params]
    assert sorted(calls) == sorted(expected)


def test_terms_sum_to_the_estimate():
    found = match_patterns(TinyLlama(vocab=64, width=32, heads=4, layers=4))
    work = Workload(batch_size=16, seq_len=8)
    lay = Layout(dp=2, pp=2, mp=2, num_microbatches=4, schedule="1F1B")
    s = step_shape.step_shape(found, work, lay, "cpu", devices_per_node=8)
    coll = cost_comm.new_counts()
    parts = [
        cost_comm.tensor_parallel_time(s, coll),
        cost_comm.data_parallel_time(s, coll),
        cost_comm.pipeline_time(s, coll),
        cost_comm.sequence_time(s, coll),
    ]
    c = cost_model.estimate(found, work, lay, "cpu", devices_per_node=8)
    assert parts == [c.time.tensor_parallel, c.time.data_parallel, c.time.pipeline, 0.0]
    assert c.collectives.collective_permute == round(coll["collective_permute"]) > 0
    assert cost_memory.memory(s) == c.memory
    assert s.stage_blocks == 2 and s.staged and s.tokens_mb * 4 == s.tokens_local
