"""Applying a plan to a model: annotate, restructure (pipeline, scan, recompute, SP), place.

:func:`apply_plan` writes each parameter's planned layout into its metadata, turns the
plan's block list into a pipelined stack (``pp > 1``), a scanned stack or wrapped blocks,
sets the ZeRO layouts (:func:`shape_for_plan`, all of that) and places the parameters on
the mesh. ``to_distributed`` calls it
after it has started the run for the plan.

Example:
  >>> _padded(("mp",), 3)
  ('mp', None, None)
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from jfleet.auto_parallel.apply.blocks import (
    container_of,
    pipeline_blocks,
    wrap_blocks,
)
from jfleet.auto_parallel.apply.expert_rows import ring_ragged_experts
from jfleet.auto_parallel.apply.expert_tokens import gather_expert_tokens
from jfleet.auto_parallel.apply.scanned_blocks import scan_blocks
from jfleet.auto_parallel.apply.sequence_dots import pin_sequence_projections
from jfleet.auto_parallel.match.block_extras import BlockOutputs
from jfleet.auto_parallel.match.matched import module_at
from jfleet.auto_parallel.match.patterns import path_str
from jfleet.auto_parallel.search.plan import Plan
from jfleet.mesh.placement import Placement
from jfleet.mesh.topology import EP, MP, PP, SEP


def _expert_stacks(plan: Plan) -> dict[str, int]:
    """The expert parameters of the plan's MoE layers and the dimension ``ep`` splits
    (a stack's first, a listed expert's hidden one), relative to each layer (alike in
    every layer)."""
    found = set()
    for layer in plan.moe_layers:
        found.add(
            tuple(
                sorted(
                    (p.path[len(layer) + 1 :], _ep_dim(p.spec))
                    for p in plan.params
                    if p.path.startswith(layer + ".")
                    and (p.role == "expert" or _ep_dim(p.spec) is not None)
                )
            )
        )
    if len(found) != 1 or not next(iter(found)):
        raise ValueError(
            f"the plan's MoE layers {list(plan.moe_layers)} do not hold the same expert "
            f"parameters ({sorted(found)}); make the plan again."
        )
    return {path: dim or 0 for path, dim in found.pop()}


def _ep_dim(spec: Any) -> int | None:
    for d, entry in enumerate(spec):
        if entry == EP or (isinstance(entry, tuple) and EP in entry):
            return d
    return None


def _padded(spec: Any, ndim: int) -> tuple:
    """A spec as metadata: one entry per dimension."""
    return tuple(spec) + (None,) * (ndim - len(spec))


def apply_plan(
    model: nnx.Module,
    plan: Plan,
    placement: Placement,
    per_sample: tuple | None = None,
    *,
    scan: bool = False,
    outputs: BlockOutputs | None = None,
) -> None:
    """Annotates, restructures (pipeline, recompute, SP) and places ``model`` for ``plan``
    (:func:`shape_for_plan`, then :meth:`~jfleet.mesh.placement.Placement.place_params`)."""
    shape_for_plan(model, plan, placement, per_sample, scan=scan, outputs=outputs)
    placement.place_params(model)


def shape_for_plan(
    model: nnx.Module,
    plan: Plan,
    placement: Placement,
    per_sample: tuple | None = None,
    *,
    scan: bool = False,
    outputs: BlockOutputs | None = None,
) -> None:
    """Annotates and restructures ``model`` for ``plan``, placing nothing (it may be traced:
    :func:`~jfleet.mesh.create.create_placed` runs it inside ``jax.jit``).

    The plan's ``moe_layers`` (a traced dispatch over ``ep`` > 1) have their tokens
    gathered over ``ep``: at their boundary for an einsum dispatch
    (:func:`~jfleet.auto_parallel.apply.expert_tokens.gather_expert_tokens`), in a
    ``shard_map`` for a ``ragged_dot`` one
    (:func:`~jfleet.auto_parallel.apply.expert_rows.ring_ragged_experts`).

    The layouts are the plan's, computed once by the planner: each parameter's
    ``out_sharding`` is its ``spec`` and, with ZeRO, its ``optimizer_sharding`` (the
    layout Flax gives its optimizer state) its ``zero_spec``. The parameters of a
    pipelined stack, which the plan names block by block, take the stack's layout; those
    of a scanned stack (``scan``) keep each block's, behind the stacked axes. ``outputs``:
    what a pipelined or scanned block returns besides its activation (None: the activation
    alone).
    """
    params = {p.path: p for p in plan.params}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        spec = params[path_str(path)].spec
        var.set_metadata(out_sharding=_padded(spec, var.ndim), mesh=placement.mesh)
    degrees = plan.mesh_shape
    seq_axes = tuple(
        a for a in (SEP, MP) if degrees[a] > 1 and (a == SEP or plan.sequence_parallel)
    )
    seq_axes = seq_axes or None
    if seq_axes is not None and MP in seq_axes and plan.blocks:
        # Megatron's program inside the blocks (before stacking: the stack keeps the first
        # block's layers): all-gather before a column projection, reduce-scatter after a
        # row one
        pin_sequence_projections(
            model, {path: (p.role, p.spec) for path, p in params.items()}, plan.blocks,
            placement.mesh, tuple(a for a in seq_axes if a != MP),
        )  # fmt: skip
    if plan.moe_dispatch in ("ragged", "gather", "list"):  # run in a shard_map over ep
        stacks = _expert_stacks(plan)
        listed = plan.moe_dispatch == "list"
        ring_ragged_experts(model, plan.moe_layers, placement.mesh, stacks, listed)
    elif plan.moe_layers:  # a traced model's own einsum dispatch over ep
        gather_expert_tokens(model, plan.moe_layers, placement.mesh)
    selective = plan.layout.selective_recompute
    if plan.blocks and degrees[PP] > 1:
        container = container_of(model, plan.blocks)
        pipeline_blocks(
            model,
            container,
            mesh=placement.mesh,
            num_microbatches=plan.num_microbatches,
            recompute=plan.recompute,
            seq_axes=seq_axes,
            per_sample=per_sample,
            schedule=plan.schedule or "FThenB",
            num_virtual_stages=plan.layout.num_virtual_stages,
            outputs=outputs,
            selective=selective,
        )
    elif scan:
        if plan.zero_stage:  # before stacking: the stack keeps each block's ZeRO layout
            _set_zero_layouts(model, params)
        scan_blocks(
            model,
            container_of(model, plan.blocks),
            recompute=plan.recompute,
            mesh=placement.mesh,
            seq_axes=seq_axes,
            selective=selective,
            outputs=outputs,
        )
    elif plan.blocks and (plan.recompute or selective or seq_axes):
        blocks = [module_at(model, b) for b in plan.blocks]
        wrap_blocks(
            blocks,
            recompute=plan.recompute,
            mesh=placement.mesh,
            seq_axes=seq_axes,
            selective=selective,
        )
    if plan.zero_stage:  # after the restructuring: stacking keeps the first block's metadata
        _set_zero_layouts(model, params)


def _set_zero_layouts(model: nnx.Module, params: dict) -> None:
    """Each parameter the plan names, at its planned shape, gets the plan's ZeRO layout."""
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        entry = params.get(path_str(path))
        if entry is not None and entry.shape == tuple(var.shape):
            var.set_metadata(optimizer_sharding=_padded(entry.zero_spec, var.ndim))
