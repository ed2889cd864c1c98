"""``paddle.incubate.distributed.models.moe.gate``: :mod:`jfleet.parallel.moe.gates`."""

from __future__ import annotations

from jfleet.parallel.moe.gates import BaseGate as BaseGate
from jfleet.parallel.moe.gates import GShardGate as GShardGate
from jfleet.parallel.moe.gates import NaiveGate as NaiveGate
from jfleet.parallel.moe.gates import SwitchGate as SwitchGate

__all__ = ["BaseGate", "GShardGate", "NaiveGate", "SwitchGate"]
