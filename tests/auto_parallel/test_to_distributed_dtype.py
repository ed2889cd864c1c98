"""``to_distributed`` plans at the strategy's AMP dtype (issue 26): a bf16 run at bf16 rates."""

from __future__ import annotations

import importlib

import optax
import pytest

from jfleet import DistributedStrategy
from jfleet.auto_parallel import ToDistributedConfig
from jfleet.models import lm_batches
from jfleet.models.llama import TinyLlama

to_distributed_module = importlib.import_module("jfleet.auto_parallel.to_distributed")


class _PlannedError(Exception):
    pass


def _planned_dtype(monkeypatch, strategy):
    seen = {}

    def spy(model, **kwargs):
        seen.update(kwargs)
        raise _PlannedError

    monkeypatch.setattr(to_distributed_module, "plan_for", spy)
    config = ToDistributedConfig(strategy=strategy)
    with pytest.raises(_PlannedError):
        to_distributed_module.to_distributed(
            TinyLlama(), optax.adam(1e-3), lm_batches(1, batch=8), device_num=8, config=config
        )
    return seen["dtype"]


@pytest.mark.parametrize(
    ("configs", "expected"),
    [
        ({"dtype": "bfloat16"}, "bfloat16"),
        ({"dtype": "float16"}, "float16"),
        ({"use_pure_bf16": True}, "bfloat16"),
    ],
)
def test_amp_dtype_reaches_the_planner(monkeypatch, configs, expected):
    strategy = DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = configs
    assert _planned_dtype(monkeypatch, strategy) == expected


def test_without_amp_the_model_dtype_is_planned(monkeypatch):
    assert _planned_dtype(monkeypatch, DistributedStrategy()) is None
