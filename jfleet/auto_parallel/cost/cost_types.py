"""What the cost model predicts for one layout: memory, step time and collective bytes.

:class:`Memory`, :class:`StepTime` and :class:`Collectives` hold one layout's predictions
by cause; :class:`Candidate` bundles them with the layout and, after
:func:`~jfleet.auto_parallel.cost.cost_model.rank`, whether it fits and why it lost. The
formulas are :mod:`jfleet.auto_parallel.cost.cost_model`'s.

Example:
  >>> m = Memory(params=4, optimizer=8, inputs=1, grads=4, gathered=0, activations=3)
  >>> m.resident, m.temp, m.total
  (13, 8, 21)
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from jfleet.auto_parallel.cost.layout import Layout

__all__ = ["TIME_WORDS", "Candidate", "Collectives", "GiB", "Memory", "StepTime", "gib_text"]

GiB = 2**30
T = TypeVar("T")


def assembled(cls: type[T], fields: dict[str, Any]) -> T:
    """``cls(**fields)`` of a frozen dataclass without ``__post_init__``, given every field
    (in field order), set at once: the frozen ``__init__`` sets each through
    ``object.__setattr__``, and building a layout's four predictions so was a fifth of its
    estimate, which planning runs once a layout (244,140 times for Qwen3-235B-A22B on 256
    GPUs).

    >>> assembled(Collectives, dict(all_reduce=1, reduce_scatter=0, all_gather=2,
    ...                             collective_permute=0, all_to_all=0)) == Collectives(
    ...     all_reduce=1, all_gather=2)
    True
    """
    made = object.__new__(cls)
    made.__dict__.update(fields)
    return made


def gib_text(n: float) -> str:
    return f"{n / GiB:.3g} GiB" if n >= 2**27 else f"{n / 2**20:.3g} MiB"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Memory:
    """Predicted bytes per device (formulas: :mod:`jfleet.auto_parallel.cost.cost_model`).

    Attributes:
      params: resident parameters (ZeRO-3: the shard).
      optimizer: optimizer state.
      inputs: the batch.
      grads: the local gradient the step holds at its end (the ZeRO-2 / 3 shard where
        the profile reduce-scatters it as it is produced).
      gathered: ZeRO-3 parameters gathered for the step (0 otherwise).
      activations: activations live between the forward and the backward pass.
      grad_copies: gradient-sized buffers at the end of the backward pass: 2 where the
        whole local gradient is live beside the reduction's output (XLA:CPU; 3 for
        half-precision gradients, which XLA:CPU reduces in fp32: the output is twice their
        size), 1 where gradients are reduced as they are produced.
    """

    params: int
    optimizer: int
    inputs: int
    grads: int
    gathered: int
    activations: int
    grad_copies: float = 2

    @property
    def resident(self) -> int:
        """Bytes kept between steps (the step's arguments)."""
        return self.params + self.optimizer + self.inputs

    @property
    def temp(self) -> int:
        """Bytes of the step's temporaries at its peak."""
        return max(self.activations + self.gathered, int(self.grad_copies * self.grads))

    @property
    def total(self) -> int:
        """Peak bytes per device: resident + temp."""
        return self.resident + self.temp


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepTime:
    """Predicted seconds per step, by cause.

    Attributes:
      compute: matmul time at peak (recompute included), without the bubble.
      bubble: pipeline bubble (idle stage time).
      tensor_parallel: ``mp`` all-reduces of activations.
      data_parallel: gradient reduction and ZeRO all-gathers.
      pipeline: point-to-point transfers between stages.
      sequence: ``sep`` all-gathers / reduce-scatters of k and v.
      memory_traffic: the residuals the step's loops (pipeline ticks, a scan over
        layers) stash and fetch, at the profile's memory bandwidth.
      expert_parallel: the MoE layers' all-to-alls over ``ep`` (dispatch and combine).
    """

    compute: float
    bubble: float = 0.0
    tensor_parallel: float = 0.0
    data_parallel: float = 0.0
    pipeline: float = 0.0
    sequence: float = 0.0
    memory_traffic: float = 0.0
    expert_parallel: float = 0.0

    @property
    def total(self) -> float:
        """Sum of the parts (no overlap)."""
        return (
            self.compute
            + self.bubble
            + self.tensor_parallel
            + self.data_parallel
            + self.pipeline
            + self.sequence
            + self.memory_traffic
            + self.expert_parallel
        )

    @property
    def communication(self) -> float:
        """All communication time."""
        return (
            self.tensor_parallel
            + self.data_parallel
            + self.pipeline
            + self.sequence
            + self.expert_parallel
        )


TIME_WORDS = {
    "compute": "compute",
    "bubble": "pipeline bubble",
    "tensor_parallel": "tensor-parallel all-reduce",
    "data_parallel": "gradient reduction / ZeRO gather",
    "pipeline": "pipeline transfer",
    "sequence": "sequence-parallel gather",
    "memory_traffic": "loop memory traffic",
    "expert_parallel": "expert token exchange",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collectives:
    """Predicted collective bytes per device per step.

    Counted as :func:`jfleet.testing.hlo.summarize` counts a compiled step's.
    """

    all_reduce: int = 0
    reduce_scatter: int = 0
    all_gather: int = 0
    collective_permute: int = 0
    all_to_all: int = 0

    @property
    def total(self) -> int:
        """All kinds together."""
        return (
            self.all_reduce
            + self.reduce_scatter
            + self.all_gather
            + self.collective_permute
            + self.all_to_all
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One layout with its predictions; after :func:`rank`, whether it fits and why it lost.

    Attributes:
      layout: the layout.
      flops: predicted dot FLOPs per device per step, as executed (bubble ticks skipped):
        what ``jfleet.testing.hlo.executed_flops`` counts for the compiled step's slowest
        stage (``dot_flops`` without a pipeline).
      memory: predicted bytes per device.
      time: predicted seconds per step.
      collectives: predicted collective bytes per device per step.
      fits: predicted total <= the memory budget.
      reason: ``"best"`` for the winner, else why it lost.

    Example:
      >>> from jfleet.auto_parallel import plan_for
      >>> from jfleet.models.llama import TinyLlama
      >>> plan = plan_for(TinyLlama(), device_num=8, batch_size=64, seq_len=8)
      >>> best = plan.candidates[0]
      >>> best.layout.name, best.fits, best.reason
      ('dp8', True, 'best')
    """

    layout: Layout
    memory: Memory
    time: StepTime
    collectives: Collectives
    flops: float = 0.0
    fits: bool = True
    reason: str = ""
