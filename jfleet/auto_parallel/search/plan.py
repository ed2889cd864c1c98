"""The plan: the chosen layout as data (:func:`~.planner.plan_for` makes one).

The :class:`Plan` holds the mesh, each
parameter's ``PartitionSpec`` (before ZeRO, and with the ZeRO axis), the pipeline stages
and micro-batches, the ZeRO stage, the predicted time and memory with their breakdown,
and every candidate with the reason it lost. ``print(plan)`` is a table;
``plan.to_json()`` / ``Plan.from_json()`` round-trip it, so a plan can be stored and
passed back to reproduce a run.

Example:
  >>> from jfleet.auto_parallel import plan_for
  >>> from jfleet.models.llama import TinyLlama
  >>> plan = plan_for(TinyLlama(), device_num=8, batch_size=64, seq_len=8)
  >>> Plan.from_json(plan.to_json()) == plan
  True
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jfleet.auto_parallel.cost.cost_model import Candidate, Collectives, Memory, StepTime
from jfleet.auto_parallel.cost.layout import Layout
from jfleet.auto_parallel.cost.profiles import HardwareProfile
from jfleet.auto_parallel.match.patterns import path_str
from jfleet.mesh.topology import EP
from jfleet.runtime.log import logger

__all__ = ["ParamPlan", "Plan", "spec_from_json", "spec_to_json", "split_devices"]

_FORMAT = 1
_SHOWN = 12


def spec_to_json(spec: P) -> list:
    """A ``PartitionSpec`` as JSON: one entry per dim, ``None``, an axis, or a list of axes.

    >>> spec_to_json(P(("sharding", "mp"), None))
    [['sharding', 'mp'], None]
    """
    return [list(e) if isinstance(e, tuple | list) else e for e in spec]


def spec_from_json(entries: Sequence[Any]) -> P:
    """The inverse of :func:`spec_to_json`.

    >>> spec_from_json([["sharding", "mp"], None])
    P(('sharding', 'mp'), None)
    """
    return P(*(tuple(e) if isinstance(e, list) else e for e in entries))


def split_devices(total: int, node_num: int) -> int:
    """Devices per node when ``total`` devices are spread over ``node_num`` nodes.

    Raises:
      ValueError: ``node_num`` < 1 or not dividing ``total``.

    >>> split_devices(16, 2)
    8
    """
    if isinstance(node_num, bool) or not isinstance(node_num, int) or node_num < 1:
        raise ValueError(f"node_num={node_num!r} must be an int >= 1.")
    if total % node_num:
        options = [d for d in range(1, total + 1) if total % d == 0]
        raise ValueError(
            f"node_num={node_num} does not divide the {total} devices; every node must hold "
            f"the same number of devices (use node_num in {options})."
        )
    return total // node_num


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamPlan:
    """One parameter's place in the plan.

    Attributes:
      path: dotted path (``layers.0.self_attn.q_proj.kernel``).
      shape: global shape.
      dtype: dtype name.
      role: the matched role, or None (replicated).
      spec: the layout before ZeRO (tensor parallel over ``mp``); what the engine reads
        from a Param's ``out_sharding`` metadata.
      zero_spec: ``spec`` with the ZeRO axis added
        (:meth:`~jfleet.placement.Placement.zero_spec`); the layout of the optimizer state
        at ZeRO >= 1, of the gradients at >= 2 and of the parameter itself at 3. Equal to
        ``spec`` at stage 0. ``to_distributed`` applies it as it stands here (it is
        computed once, when the plan is made).
      stage: the pipeline stage holding it (None outside the decoder blocks, which every
        stage holds).
      replicated_why: for a decoder-block parameter kept whole on every ``mp`` rank (other
        than norms and rows' biases), the reason; else empty.

    Example:
      >>> import optax
      >>> from jfleet.auto_parallel import ToDistributedConfig, get_plan, to_distributed
      >>> from jfleet.models import lm_batches
      >>> from jfleet.models.llama import TinyLlama
      >>> config = ToDistributedConfig(force_mesh={"dp": 2, "mp": 4})
      >>> model = TinyLlama(vocab=64, width=32, heads=8, kv_heads=4, layers=2)
      >>> model, _, _ = to_distributed(model, optax.sgd(0.1), lm_batches(1), config=config)
      >>> plan = get_plan(model)
      >>> p = next(p for p in plan.params if p.path.endswith("q_proj.kernel"))
      >>> p.role, p.spec
      ('q', P(None, 'mp'))
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    role: str | None
    spec: P
    zero_spec: P
    stage: int | None = None
    replicated_why: str = ""


def _normal_spec(spec: Sequence[Any], ndim: int) -> P:
    """``spec`` over ``ndim`` dims: ``P()`` when it splits nothing, else one entry a dim."""
    entries = tuple(spec)[:ndim]
    if all(e is None for e in entries):
        return P()
    return P(*entries, *([None] * (ndim - len(entries))))


def _same_spec(a: P, b: P, ndim: int) -> bool:
    return _normal_spec(a, ndim) == _normal_spec(b, ndim)


def _placed_specs(model: nnx.Module, blocks: Sequence[str]) -> dict[str, tuple[tuple, int]]:
    """``{plan path: (spec entries, ndim)}`` of every placed array of ``model``; a stacked
    leaf (``<container>.body.<rest>``) speaks for ``<block>.<rest>`` of each block it holds."""
    containers: dict[str, list[str]] = collections.defaultdict(list)
    for b in blocks:
        containers[b.rsplit(".", 1)[0] if "." in b else ""].append(b)
    out: dict[str, tuple[tuple, int]] = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var.get_value()
        spec = getattr(value.sharding, "spec", None) if isinstance(value, jax.Array) else None
        if spec is None:
            continue
        entries = tuple(spec) + (None,) * (value.ndim - len(spec))
        name = path_str(path)
        head, sep, rest = name.partition(".body.")
        for target in [f"{b}.{rest}" for b in containers.get(head, ())] if sep else [name]:
            out[target] = (entries, value.ndim)
    return out


def _candidate_to_dict(c: Candidate) -> dict[str, Any]:
    return {
        # ep of degree 1 (every model without routed experts): left out, so plans read as
        # before the axis
        "layout": {k: v for k, v in dataclasses.asdict(c.layout).items() if k != EP or v != 1},
        "memory": dataclasses.asdict(c.memory),
        # no expert all-to-all (a model without routed experts): left out, as before
        "time": {
            k: v for k, v in dataclasses.asdict(c.time).items() if k != "expert_parallel" or v
        },
        "collectives": dataclasses.asdict(c.collectives),
        "flops": c.flops,
        "fits": c.fits,
        "reason": c.reason,
    }


def _candidate_from_dict(d: Mapping[str, Any]) -> Candidate:
    return Candidate(
        layout=Layout(**d["layout"]),
        memory=Memory(**d["memory"]),
        time=StepTime(**d["time"]),
        collectives=Collectives(**d["collectives"]),
        flops=d.get("flops", 0.0),
        fits=d["fits"],
        reason=d["reason"],
    )


def _mib(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.2f} MiB"


def _secs(t: float) -> str:
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} us"


def _spec_text(spec: P) -> str:
    return "P(" + ", ".join(repr(e) for e in spec) + ")"


def _blocks_text(blocks: tuple[int, ...]) -> str:
    """``blocks 0-1``, ``block 3``, or runs for an interleaved stage: ``blocks 0-1, 4-5``."""
    runs: list[list[int]] = []
    for b in blocks:
        if runs and b == runs[-1][-1] + 1:
            runs[-1].append(b)
        else:
            runs.append([b])
    shown = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)
    return f"block {shown}" if len(blocks) == 1 else f"blocks {shown}"


def _uneven_text(stages: tuple[tuple[int, ...], ...]) -> str:
    """`` (uneven: stages of 3,2 blocks; the largest charged)`` when the stages differ.

    >>> _uneven_text(((0, 1, 2), (3, 4)))
    ' (uneven: stages of 3,2 blocks; time and memory charged for the largest)'
    """
    sizes = [len(s) for s in stages]
    if len(set(sizes)) <= 1:
        return ""
    shown = ",".join(map(str, sizes))
    return f" (uneven: stages of {shown} blocks; time and memory charged for the largest)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """A parallel plan: the mesh, the layouts, the pipeline, and why it was chosen.

    Attributes:
      mesh: ``(axis, size)`` pairs in mesh order ``dp, pp, sharding, sep, mp`` (``ep`` only above
        degree 1: it is not planned yet).
      zero_stage: 0 (none), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters),
        over the ``sharding`` axis.
      schedule: ``"FThenB"`` or ``"1F1B"`` when ``pp > 1``, else None.
      num_microbatches: micro-batches per step (1 without a pipeline).
      recompute: recompute block activations in the backward pass.
      sequence_parallel: split activations between tensor-parallel regions over ``mp``.
      params: every parameter's :class:`ParamPlan`, in ``nnx.state`` order.
      blocks: module paths of the decoder blocks (the pipeline candidate).
      stages: block indices per pipeline stage (one tuple with all blocks when
        ``pp == 1``; empty without blocks); with VPP a stage's chunks, ``(0, 1, 4, 5)``.
      chosen: the winning candidate (layout, predicted memory, time, collectives).
      candidates: every candidate, ranked, each with the reason it lost.
      excluded: ``(mesh, reason)`` for factorisations the shapes rule out.
      architecture: one line describing what was matched.
      unmatched: parameter paths that matched no pattern (kept replicated).
      notes: why parts were left unmatched; how the attention was charged (fused or
        materialised ``s x s`` scores) and why.
      batch_size: global batch.
      seq_len: sequence length.
      dtype: compute dtype.
      optimizer: optimizer name the memory was predicted for.
      device_num: devices per node.
      node_num: nodes.
      profile: the hardware profile.
      memory_budget: bytes per device.
      workload: the inputs in their own words when they are not token ids (``images 32 x
        28x28x1``; :meth:`~jfleet.auto_parallel.match.matched.ModelPatterns.workload`); empty:
        ``batch x seq`` of tokens.
      moe_layers: module paths of a traced model's MoE layers whose tokens are gathered over
        ``ep`` (its own dispatch over ``ep`` > 1); empty otherwise.
      moe_dispatch: how ``moe_layers`` run: ``"einsum"``, sharding constraints at their
        boundary (:mod:`jfleet.auto_parallel.apply.expert_tokens`), or ``"ragged"`` /
        ``"gather"``, a ``shard_map`` restricting each ``ragged_dot`` (each product with
        gathered expert weights) to a rank's experts
        (:mod:`jfleet.auto_parallel.apply.expert_rows`); empty without ``moe_layers``.

    Example:
      >>> import optax
      >>> from jfleet.auto_parallel import ToDistributedConfig, get_plan, to_distributed
      >>> from jfleet.models import lm_batches
      >>> from jfleet.models.llama import TinyLlama
      >>> config = ToDistributedConfig(force_mesh={"dp": 2, "mp": 4})
      >>> model = TinyLlama(vocab=64, width=32, heads=8, kv_heads=4, layers=2)
      >>> model, _, _ = to_distributed(model, optax.sgd(0.1), lm_batches(1), config=config)
      >>> plan = get_plan(model)
      >>> plan.layout.name, plan.zero_stage
      ('dp2 x mp4', 0)
      >>> Plan.from_json(plan.to_json()).layout == plan.layout  # stored, reproduced
      True
    """

    mesh: tuple[tuple[str, int], ...]
    zero_stage: int
    schedule: str | None
    num_microbatches: int
    recompute: bool
    sequence_parallel: bool
    params: tuple[ParamPlan, ...]
    blocks: tuple[str, ...]
    stages: tuple[tuple[int, ...], ...]
    chosen: Candidate
    candidates: tuple[Candidate, ...]
    excluded: tuple[tuple[str, str], ...]
    architecture: str
    unmatched: tuple[str, ...]
    notes: tuple[str, ...]
    batch_size: int
    seq_len: int
    dtype: str
    optimizer: str
    device_num: int
    node_num: int
    profile: HardwareProfile
    memory_budget: int
    workload: str = ""
    moe_layers: tuple[str, ...] = ()
    moe_dispatch: str = ""

    # ------------------------------------------------------------ views
    @property
    def mesh_shape(self) -> dict[str, int]:
        """``{axis: size}`` in mesh order."""
        return dict(self.mesh)

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The mesh's axis names (degree-1 axes kept; ``ep``, which is not planned yet, only
        above degree 1)."""
        return tuple(a for a, _ in self.mesh)

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        """The mesh's axis sizes."""
        return tuple(n for _, n in self.mesh)

    @property
    def layout(self) -> Layout:
        """The chosen :class:`~jfleet.auto_parallel.search.layouts.Layout`."""
        return self.chosen.layout

    @property
    def specs(self) -> dict[str, P]:
        """``{path: spec}``: every parameter's layout before ZeRO."""
        return {p.path: p.spec for p in self.params}

    @property
    def zero_specs(self) -> dict[str, P]:
        """``{path: zero_spec}``: every parameter's layout with the ZeRO axis."""
        return {p.path: p.zero_spec for p in self.params}

    def spec(self, path: str) -> P:
        """The layout (before ZeRO) of the parameter at ``path``.

        Raises:
          KeyError: no such parameter (the message lists a few that exist).
        """
        return self._param(path).spec

    def stage_of(self, path: str) -> int | None:
        """The pipeline stage holding the parameter at ``path`` (None: every stage)."""
        return self._param(path).stage

    def _param(self, path: str) -> ParamPlan:
        for p in self.params:
            if p.path == path:
                return p
        some = ", ".join(p.path for p in self.params[:5])
        raise KeyError(f"{path!r} is not a parameter of this plan; e.g. {some}")

    # ------------------------------------------------------------ applying helpers
    def partition_specs(self, state: nnx.State, *, zero: bool = False) -> nnx.State:
        """A tree like ``state`` (``nnx.Param`` state) with each leaf's ``PartitionSpec``.

        Args:
          state: ``nnx.state(model, nnx.Param)`` of the model the plan was made for.
          zero: the ZeRO layouts (``zero_spec``) instead of the tensor-parallel ones.

        Raises:
          ValueError: a parameter the plan does not know, or one whose shape changed.
        """
        self.validate(state)
        table = self.zero_specs if zero else self.specs

        def one(path: tuple, var: Any) -> Any:
            return var.replace(table[path_str(path)])

        return nnx.map_state(one, state)

    def validate(self, model_or_state: nnx.Module | nnx.State) -> None:
        """Checks that a model (or its Param state) has exactly this plan's parameters.

        Raises:
          ValueError: listing every missing, extra or reshaped parameter.
        """
        state = model_or_state
        if isinstance(state, nnx.Module):
            state = nnx.state(state, nnx.Param)
        have = {path_str(p): tuple(v.get_value().shape) for p, v in nnx.to_flat_state(state)}
        want = {p.path: p.shape for p in self.params}
        missing = sorted(set(want) - set(have))
        extra = sorted(set(have) - set(want))
        reshaped = sorted(k for k in set(want) & set(have) if want[k] != have[k])
        if missing or extra or reshaped:
            raise ValueError(
                "the model does not match the plan: "
                + "; ".join(
                    f"{label}: {items[:8]}{' ...' if len(items) > 8 else ''}"
                    for label, items in (
                        ("missing", missing),
                        ("not in the plan", extra),
                        ("shape changed", [f"{k} {want[k]} -> {have[k]}" for k in reshaped]),
                    )
                    if items
                )
                + ". Make a new plan for this model."
            )

    def as_placed(self, model: nnx.Module) -> Plan:
        """This plan with its parameter table read back from ``model``'s placed arrays.

        Each parameter's ``spec`` (``zero_spec`` at ZeRO-3, where the parameters carry the
        ZeRO axis) becomes the ``PartitionSpec`` its array was placed with; a pipelined or
        scanned stack's leaf (``layers.body.…``, stacked axes first) gives its spec, past
        the stacked axes, to every block it holds. A layout placed otherwise than planned
        is logged. ``to_distributed`` stores the plan this returns, so the table printed is
        what the arrays are.

        Example:
          >>> import jax
          >>> from jfleet.auto_parallel import plan_for
          >>> from jfleet.models.llama import TinyLlama
          >>> plan = plan_for(TinyLlama(), device_num=1, batch_size=8, seq_len=8)
          >>> plan.as_placed(TinyLlama()) == plan  # unplaced arrays: nothing to read
          True
        """
        placed = _placed_specs(model, self.blocks)
        params, moved = [], []
        zero3 = self.zero_stage >= 3
        for p in self.params:
            entries, ndim = placed.get(p.path, (None, 0))
            lead = ndim - len(p.shape)  # a stack's leading axes
            known = entries is not None and lead >= 0
            spec = _normal_spec(entries[lead:], len(p.shape)) if known else None
            planned = p.zero_spec if zero3 else p.spec
            if spec is None or _same_spec(spec, planned, len(p.shape)):
                params.append(p)
                continue
            moved.append(f"{p.path}: planned {planned}, placed {spec}")
            field = "zero_spec" if zero3 else "spec"
            params.append(dataclasses.replace(p, **{field: spec}))
        if moved:
            logger.warning("plan: placed otherwise than planned: %s", "; ".join(moved[:6]))
        return dataclasses.replace(self, params=tuple(params)) if moved else self

    # ------------------------------------------------------------ text
    def __str__(self) -> str:
        lay = self.layout
        mem, t = self.chosen.memory, self.chosen.time
        total = self.device_num * self.node_num
        lines = [
            f"jfleet plan: {lay.name} on {total} devices ({self.node_num} node(s) x "
            f"{self.device_num}), profile {self.profile.name}, budget "
            f"{_mib(self.memory_budget)}/device",
            f"model: {self.architecture}",
            f"workload: {self.workload or f'batch {self.batch_size} x seq {self.seq_len}'}, "
            f"{self.dtype}, "
            f"{self.optimizer}",
            "mesh: "
            + " ".join(f"{a}={n}" for a, n in self.mesh)
            + f" | ZeRO-{self.zero_stage}"
            + (
                f" | pipeline {self.schedule}, {self.num_microbatches} micro-batches"
                + (
                    f", {lay.num_virtual_stages} virtual stages"
                    if lay.num_virtual_stages > 1
                    else ""
                )
                if lay.pp > 1
                else " | no pipeline"
            )
            + (" | recompute" if self.recompute else "")
            + (" | selective recompute" if lay.selective_recompute else "")
            + (f" | accumulate {lay.accumulate_steps}" if lay.accumulate_steps > 1 else "")
            + (" | sequence parallel" if self.sequence_parallel else ""),
            f"predicted per device: {_mib(mem.total)} (params {_mib(mem.params)}, optimizer "
            f"{_mib(mem.optimizer)}, grads {_mib(mem.grads)}, activations "
            f"{_mib(mem.activations)}"
            + (f", gathered {_mib(mem.gathered)}" if mem.gathered else "")
            + f"); step {_secs(t.total)} (compute {_secs(t.compute)}"
            + "".join(
                f", {label} {_secs(v)}"
                for label, v in (
                    ("bubble", t.bubble),
                    ("tensor-parallel", t.tensor_parallel),
                    ("data-parallel", t.data_parallel),
                    ("pipeline", t.pipeline),
                    ("sequence", t.sequence),
                    ("loop memory traffic", t.memory_traffic),
                    ("expert token exchange", t.expert_parallel),
                )
                if v
            )
            + ")",
        ]
        if lay.pp > 1:
            lines.append(
                "stages: "
                + "; ".join(f"{i}: {_blocks_text(s)}" for i, s in enumerate(self.stages))
                + _uneven_text(self.stages)
            )
        lines.append(
            "unmatched (replicated): " + (", ".join(self.unmatched) if self.unmatched else "none")
        )
        lines += [f"note: {n}" for n in self.notes]
        lines += [
            "",
            "| rank | layout | memory/device | step | compute+bubble | tensor-par. "
            "| data-par. | pipeline | loop traffic | fits | why not chosen |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for i, c in enumerate(self.candidates[:_SHOWN], 1):
            lines.append(
                f"| {i} | {c.layout.name} | {_mib(c.memory.total)} | {_secs(c.time.total)} "
                f"| {_secs(c.time.compute + c.time.bubble)} "
                f"| {_secs(c.time.tensor_parallel)} | {_secs(c.time.data_parallel)} "
                f"| {_secs(c.time.pipeline)} | {_secs(c.time.memory_traffic)} "
                f"| {'yes' if c.fits else 'no'} "
                f"| {c.reason.replace('best', 'chosen', 1) if i == 1 else c.reason} |"
            )
        hidden = len(self.candidates) - _SHOWN
        if hidden > 0:
            lines.append(f"({hidden} more candidates in plan.candidates)")
        if self.excluded:
            lines.append(
                f"excluded meshes ({len(self.excluded)}): "
                + "; ".join(f"{m}: {r}" for m, r in self.excluded[:6])
                + (" ..." if len(self.excluded) > 6 else "")
            )
        lines += [
            "",
            "| parameter | shape | role | spec | ZeRO spec | stage | replicated because |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in self._grouped_params():
            lines.append("| " + " | ".join(row) + " |")
        return "\n".join(lines)

    def _grouped_params(self) -> list[list[str]]:
        """Parameter rows, one per parameter outside the blocks and one per block slot."""
        rows: list[list[str]] = []
        seen: dict[str, list] = collections.OrderedDict()
        for p in self.params:
            key = p.path
            in_block = False
            for b in self.blocks:
                if p.path.startswith(b + "."):
                    parent = b.rsplit(".", 1)[0] if "." in b else ""
                    key = f"{parent}[*]{p.path[len(b) :]}"
                    in_block = True
                    break
            entry = seen.setdefault(key, [p, set()])
            if in_block:
                entry[1].add(p.stage)
        pipelined = self.layout.pp > 1
        for key, (p, stage_set) in seen.items():
            stage = (
                "all"
                if p.stage is None or not pipelined
                else ",".join(str(s) for s in sorted(stage_set))
                if stage_set
                else str(p.stage)
            )
            rows.append(
                [
                    key,
                    "x".join(map(str, p.shape)),
                    p.role or "-",
                    self._shown(p.spec),
                    self._shown(p.zero_spec),
                    stage,
                    p.replicated_why or "",
                ]
            )
        return rows

    def _shown(self, spec: P) -> str:
        """The spec as placed: axes of size 1 split nothing and are left out."""
        sizes = self.mesh_shape

        def keep(entry: Any) -> Any:
            axes = entry if isinstance(entry, tuple) else (entry,)
            kept = tuple(a for a in axes if a is not None and sizes.get(a, 1) > 1)
            return None if not kept else kept if len(kept) > 1 else kept[0]

        return _spec_text(P(*(keep(e) for e in spec)))

    # ------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (:meth:`from_dict` rebuilds the plan exactly)."""
        return (
            {
                "format": _FORMAT,
                "mesh": dict(self.mesh),
                "zero_stage": self.zero_stage,
                "schedule": self.schedule,
                "num_microbatches": self.num_microbatches,
                "recompute": self.recompute,
                "sequence_parallel": self.sequence_parallel,
                "params": [
                    {
                        "path": p.path,
                        "shape": list(p.shape),
                        "dtype": p.dtype,
                        "role": p.role,
                        "spec": spec_to_json(p.spec),
                        "zero_spec": spec_to_json(p.zero_spec),
                        "stage": p.stage,
                        "replicated_why": p.replicated_why,
                    }
                    for p in self.params
                ],
                "blocks": list(self.blocks),
                "stages": [list(s) for s in self.stages],
                "chosen": _candidate_to_dict(self.chosen),
                "candidates": [_candidate_to_dict(c) for c in self.candidates],
                "excluded": [list(e) for e in self.excluded],
                "architecture": self.architecture,
                "unmatched": list(self.unmatched),
                "notes": list(self.notes),
                "batch_size": self.batch_size,
                "seq_len": self.seq_len,
                "dtype": self.dtype,
                "optimizer": self.optimizer,
                "device_num": self.device_num,
                "node_num": self.node_num,
                "profile": self.profile.to_dict(),
                "memory_budget": self.memory_budget,
            }
            | ({"workload": self.workload} if self.workload else {})
            | ({"moe_layers": list(self.moe_layers)} if self.moe_layers else {})
            | ({"moe_dispatch": self.moe_dispatch} if self.moe_dispatch else {})
        )

    def to_json(self, indent: int | None = 2) -> str:
        """The plan as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        """Rebuilds a plan from :meth:`to_dict`'s output.

        Raises:
          ValueError: an unknown format version, a missing field or an unknown
            ``moe_dispatch``.
        """
        ring = d.get("moe_dispatch", "einsum" if d.get("moe_layers") else "")
        if ring not in (("einsum", "list", "ragged", "gather") if d.get("moe_layers") else ("",)):
            raise ValueError(
                f"plan JSON: moe_dispatch={ring!r} with moe_layers={d.get('moe_layers')!r}; "
                "expected 'einsum', 'list', 'ragged' or 'gather' with MoE layers, nothing without."
            )
        if d.get("format") != _FORMAT:
            raise ValueError(
                f"plan format {d.get('format')!r} is not {_FORMAT}; make the plan again with "
                "this version of jfleet."
            )
        try:
            return cls(
                mesh=tuple((a, int(n)) for a, n in d["mesh"].items()),
                zero_stage=d["zero_stage"],
                schedule=d["schedule"],
                num_microbatches=d["num_microbatches"],
                recompute=d["recompute"],
                sequence_parallel=d["sequence_parallel"],
                params=tuple(
                    ParamPlan(
                        path=p["path"],
                        shape=tuple(p["shape"]),
                        dtype=p["dtype"],
                        role=p["role"],
                        spec=spec_from_json(p["spec"]),
                        zero_spec=spec_from_json(p["zero_spec"]),
                        stage=p["stage"],
                        replicated_why=p.get("replicated_why", ""),
                    )
                    for p in d["params"]
                ),
                blocks=tuple(d["blocks"]),
                stages=tuple(tuple(s) for s in d["stages"]),
                chosen=_candidate_from_dict(d["chosen"]),
                candidates=tuple(_candidate_from_dict(c) for c in d["candidates"]),
                excluded=tuple(tuple(e) for e in d["excluded"]),
                architecture=d["architecture"],
                unmatched=tuple(d["unmatched"]),
                notes=tuple(d["notes"]),
                batch_size=d["batch_size"],
                seq_len=d["seq_len"],
                dtype=d["dtype"],
                optimizer=d["optimizer"],
                device_num=d["device_num"],
                node_num=d["node_num"],
                profile=HardwareProfile(**d["profile"]),
                memory_budget=d["memory_budget"],
                workload=d.get("workload", ""),
                moe_layers=tuple(d.get("moe_layers", ())),
                moe_dispatch=ring,
            )
        except KeyError as err:
            raise ValueError(f"plan JSON lacks the field {err.args[0]!r}.") from err

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Rebuilds a plan from :meth:`to_json`'s text."""
        return cls.from_dict(json.loads(text))
