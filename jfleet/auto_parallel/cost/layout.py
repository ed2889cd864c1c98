"""A layout and a workload: what the cost model prices.

A :class:`Layout` is one way to run a training step: the mesh degrees
``dp x pp x sharding x sep x ep x mp`` (mesh order, outermost first; ``ep`` > 1 only for
a model with routed experts), the ZeRO stage, the
pipeline schedule and micro-batch count, and recompute. A :class:`Workload` is what the
step processes (batch, sequence, dtype, optimizer). Both validate themselves; which
layouts a model's shapes allow is the search's business
(:func:`jfleet.auto_parallel.search.layouts.enumerate_layouts`).

Example:
  >>> lay = Layout(dp=2, pp=2, mp=2, schedule="1F1B", num_microbatches=4)
  >>> lay.name, lay.size, Workload(batch_size=8, seq_len=16).tokens
  ('dp2 x pp2 x mp2 (1F1B M=4)', 8, 128)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Mapping

import jax.numpy as jnp

from jfleet.mesh.topology import AXIS_NAMES, DP, SEP, SHARDING
from jfleet.parallel.virtual_stages import check_chunks_agree

__all__ = ["OPTIMIZER_MOMENTS", "SCHEDULES", "SELECTIVE", "Layout", "Workload", "mesh_name"]

#: Pipeline schedules the cost model knows (VPP: 1F1B's program over interleaved stages).
SCHEDULES = ("FThenB", "1F1B", "VPP")
#: ``recompute``'s value for selective recompute (:attr:`Layout.selective_recompute`).
SELECTIVE = "selective"
#: Optimizer state per parameter, in parameter-sized arrays.
OPTIMIZER_MOMENTS = {"adam": 2, "adamw": 2, "lamb": 2, "momentum": 1, "lars": 1, "sgd": 0}


#: A layout's degrees in mesh order.
_DEGREES = operator.attrgetter(*AXIS_NAMES)


def _count_ok(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def mesh_name(degrees: Mapping[str, int]) -> str:
    """A mesh's name: its axes of degree > 1 in mesh order, ``single device`` for none.

    >>> mesh_name({"dp": 2, "pp": 1, "mp": 4})
    'dp2 x mp4'
    >>> mesh_name({})
    'single device'
    """
    parts = [f"{a}{degrees[a]}" for a in AXIS_NAMES if degrees.get(a, 1) > 1]
    return " x ".join(parts) or "single device"


# ------------------------------------------------------------------ inputs
@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """What one training step processes.

    Attributes:
      batch_size: global batch (sequences per step).
      seq_len: tokens per sequence.
      dtype: compute / activation dtype name (``float32``, ``bfloat16``).
      optimizer: ``adam`` (2 moments), ``momentum`` (1), ``sgd`` (0), ... (see
        :data:`OPTIMIZER_MOMENTS`).
      sequence_parallel: activations between tensor-parallel regions split over ``mp``
        (Megatron SP), and ``sep`` candidates enumerated.

    Raises:
      ValueError: a non-positive size, an unknown optimizer or dtype.

    Example:
      >>> Workload(batch_size=4, seq_len=8, dtype="bfloat16").tokens
      32
    """

    batch_size: int
    seq_len: int
    dtype: str = "float32"
    optimizer: str = "adam"
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len"):
            value = getattr(self, name)
            if not _count_ok(value):
                raise ValueError(f"{name}={value!r} must be an int >= 1.")
        if self.optimizer not in OPTIMIZER_MOMENTS:
            raise ValueError(
                f"optimizer={self.optimizer!r} is not known to the cost model; use one of "
                f"{sorted(OPTIMIZER_MOMENTS)}."
            )
        try:
            jnp.dtype(self.dtype)
        except TypeError as err:
            raise ValueError(f"dtype={self.dtype!r} is not a dtype name.") from err

    @functools.cached_property
    def act_bytes(self) -> int:
        """Bytes per activation element."""
        return jnp.dtype(self.dtype).itemsize

    @property
    def tokens(self) -> int:
        """Tokens per step (batch x sequence)."""
        return self.batch_size * self.seq_len


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """One way to run the step: mesh degrees, ZeRO stage, pipeline schedule, recompute.

    Attributes:
      dp: data-parallel degree.
      pp: pipeline stages.
      sharding: ZeRO (sharding) degree; the batch is split over ``dp x sharding``.
      sep: sequence (segment) parallel degree.
      ep: expert-parallel degree (the ``ep`` mesh axis): a data axis (the batch is split
        over ``dp x sharding x ep``) over which each MoE layer's experts are split
        (:mod:`jfleet.auto_parallel.cost.cost_moe`); the search keeps it 1 for a model
        without routed experts.
      mp: tensor-parallel degree.
      zero_stage: 0 without a sharding axis, else 1, 2 or 3.
      schedule: ``"FThenB"``, ``"1F1B"`` or ``"VPP"`` when ``pp > 1``, else None.
      num_microbatches: micro-batches per step (1 without a pipeline).
      recompute: recompute each block's activations in the backward pass.
      num_virtual_stages: ``v``, chunks per stage (``"VPP"``: at least 2, and ``M`` a
        multiple of ``pp``; 1 otherwise).
      accumulate_steps: the local batch runs as this many calls of the step, one update
        on their summed gradients (gradient accumulation: the engine's gradient merge,
        ``jfleet.optim.gradient_merge``, which reduces each call's gradients); with a
        pipeline each call runs ``num_microbatches``.
      selective_recompute: recompute only the attention core and the elementwise work of
        each block, keeping its weight-matmul outputs (Megatron's ``selective``, Paddle's
        ``recompute_granularity="core_attn"``; ``jax.checkpoint`` with
        ``dots_with_no_batch_dims_saveable``). Excludes ``recompute`` (the whole block).
        With a pipeline (``"FThenB"`` and ``"1F1B"`` one program; ``"VPP"`` per chunk)
        each stage stashes its blocks' kept matmul outputs per micro-batch.
      zero_spans_data: ZeRO shards over every rank holding the same parameters,
        ``dp x sharding x sep``, not over ``sharding`` alone (Megatron's distributed
        optimizer; Paddle's ``sharding_configs["_dp_as_optimizer_sharding"]``). It makes a
        difference only with ``dp`` or ``sep`` beside a sharding axis: the state is split
        ``dp x sep`` times finer for the same wire bytes (one reduce-scatter and one
        all-gather over all of them instead of ZeRO's over ``sharding`` plus an all-reduce
        over ``dp x sep``), over the slower of their links.

    Raises:
      ValueError: a degree < 1, or an inconsistent stage / schedule / micro-batch /
        virtual stage count.

    Example:
      >>> Layout(dp=2, sharding=2, mp=2, zero_stage=3).name
      'dp2 x sharding2 x mp2 (ZeRO-3)'
    """

    dp: int = 1
    pp: int = 1
    sharding: int = 1
    sep: int = 1
    ep: int = 1
    mp: int = 1
    zero_stage: int = 0
    schedule: str | None = None
    num_microbatches: int = 1
    recompute: bool = False
    num_virtual_stages: int = 1
    accumulate_steps: int = 1
    selective_recompute: bool = False
    zero_spans_data: bool = False

    def __post_init__(self) -> None:
        if self._plainly_valid():
            return
        for name in (*AXIS_NAMES, "num_microbatches", "num_virtual_stages", "accumulate_steps"):
            value = getattr(self, name)
            if not _count_ok(value):
                raise ValueError(f"{name}={value!r} must be an int >= 1.")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={self.zero_stage!r} must be 0, 1, 2 or 3.")
        if self.zero_stage and self.sharding == 1:
            raise ValueError(
                f"zero_stage={self.zero_stage} needs a sharding axis; sharding=1 here. "
                "Use sharding > 1 or zero_stage=0."
            )
        if self.sharding > 1 and not self.zero_stage:
            raise ValueError(
                f"sharding={self.sharding} without a ZeRO stage; give zero_stage 1, 2 or 3."
            )
        if self.zero_spans_data and (not self.zero_stage or self.dp * self.sep == 1):
            raise ValueError(
                f"zero_spans_data=True with zero_stage={self.zero_stage}, dp={self.dp}, "
                f"sep={self.sep}: it widens a ZeRO stage over dp and sep; use it with "
                "zero_stage >= 1 and dp or sep > 1 (else ZeRO over sharding is the same)."
            )
        if self.pp > 1 and self.schedule not in SCHEDULES:
            raise ValueError(f"pp={self.pp} needs schedule in {SCHEDULES}; got {self.schedule!r}.")
        if self.pp == 1 and (self.schedule is not None or self.num_microbatches != 1):
            raise ValueError(
                f"schedule={self.schedule!r} / num_microbatches={self.num_microbatches} "
                "only apply with pp > 1."
            )
        if self.selective_recompute and self.recompute:
            raise ValueError(
                "selective_recompute=True with recompute=True: selective recompute keeps each "
                "block's weight-matmul outputs, whole-block recompute keeps none of them; pass "
                "one of the two."
            )
        interleaved = self.num_virtual_stages > 1
        if self.schedule is None and interleaved:
            raise ValueError(f"num_virtual_stages={self.num_virtual_stages} needs pp > 1.")
        check_chunks_agree(
            self.schedule, self.num_virtual_stages, names=("schedule", "num_virtual_stages")
        )
        if interleaved and self.num_microbatches % self.pp:
            raise ValueError(
                f"VPP runs micro-batches in groups of pp={self.pp}; num_microbatches="
                f"{self.num_microbatches} is not a multiple of it."
            )

    def _plainly_valid(self) -> bool:
        """The checks of ``__post_init__`` at once, for the layouts a search builds by the
        hundred thousand (True only where every check passes; else they run one by one).
        Any ``ep`` >= 1 passes, as one by one (it kept ``ep = 1`` from when ``ep > 1`` was
        refused, so every expert-parallel layout of a MoE search was checked one by one)."""
        v, m, pp, zero = self.num_virtual_stages, self.num_microbatches, self.pp, self.zero_stage
        counts = (*_DEGREES(self), m, v, self.accumulate_steps)
        return (
            {*map(type, counts)} == {int}
            and min(counts) >= 1
            and type(zero) is int
            and 0 <= zero <= 3
            and (zero == 0) == (self.sharding == 1)
            and (not self.zero_spans_data or (zero > 0 and self.dp * self.sep > 1))
            and (self.schedule in SCHEDULES if pp > 1 else self.schedule is None and m == 1)
            and not (self.selective_recompute and self.recompute)
            and (self.schedule == "VPP") == (v > 1)
            and (v == 1 or m % pp == 0)
        )

    @property
    def degrees(self) -> dict[str, int]:
        """``{axis: degree}`` in mesh order."""
        return {a: getattr(self, a) for a in AXIS_NAMES}

    @property
    def size(self) -> int:
        """Devices used (the product of the degrees)."""
        return math.prod(self.degrees.values())

    @property
    def data_degree(self) -> int:
        """How many ways the batch is split (dp x sharding x ep: ``ep`` is a data axis)."""
        return self.dp * self.sharding * self.ep

    @property
    def zero_axes(self) -> str | tuple[str, ...]:
        """The axis (axes) ZeRO shards over: ``"sharding"``, or with
        :attr:`zero_spans_data` those of ``dp``, ``sharding``, ``sep`` above degree 1.

        >>> Layout(dp=2, sharding=2, zero_stage=1, zero_spans_data=True).zero_axes
        ('dp', 'sharding')
        """
        if not self.zero_spans_data:
            return SHARDING
        return tuple(a for a in (DP, SHARDING, SEP) if getattr(self, a) > 1)

    @property
    def zero_degree(self) -> int:
        """How many ways ZeRO splits what it shards (1 without ZeRO)."""
        if not self.zero_stage:
            return 1
        return self.sharding * (self.dp * self.sep if self.zero_spans_data else 1)

    @property
    def mesh_name(self) -> str:
        """``dp2 x mp4``; ``single device`` when every degree is 1."""
        return mesh_name(self.degrees)

    @property
    def name(self) -> str:
        """The mesh, then ZeRO, schedule and recompute when they apply."""
        extra = []
        if self.zero_stage:
            over = " over " + " x ".join(self.zero_axes) if self.zero_spans_data else ""
            extra.append(f"ZeRO-{self.zero_stage}{over}")
        if self.num_virtual_stages > 1:
            extra.append(f"VPP v={self.num_virtual_stages} M={self.num_microbatches}")
        elif self.pp > 1:
            extra.append(f"{self.schedule} M={self.num_microbatches}")
        if self.accumulate_steps > 1:
            extra.append(f"accumulate {self.accumulate_steps}")
        if self.recompute:
            extra.append("recompute")
        if self.selective_recompute:
            extra.append("selective recompute")
        return self.mesh_name + (f" ({', '.join(extra)})" if extra else "")

    def complexity(self) -> tuple:
        """Tie-break order: fewer parallel kinds, lower ZeRO stage, no recompute first."""
        kinds = sum(d > 1 for a, d in self.degrees.items() if a != DP)
        return (
            kinds, self.zero_stage, self.zero_spans_data, self.recompute,
            self.selective_recompute, self.pp,
            self.num_virtual_stages, self.mp, self.sep, self.accumulate_steps,
        )  # fmt: skip
