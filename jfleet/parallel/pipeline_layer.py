"""Paddle's ``PipelineLayer``, ``LayerDesc`` and ``SharedLayerDesc`` as one stacked NNX module.

A :class:`PipelineLayer` is built from a list of layer descriptions, as in Paddle. The
longest run of identical consecutive :class:`LayerDesc`\\ s (same class, arguments and
keyword arguments) is the pipelined **body** (the decoder blocks); the layers before it
are the **pre** part (embedding), those after it the **post** part (final norm, LM head).

* The body's ``N`` layers are built one by one with the same ``nnx.Rngs`` sequence as
  the sequential model (so a seed builds the same parameters whatever ``num_stages``
  and the other degrees are), then each parameter is stacked to ``[P, N/P, ...]`` with
  ``out_sharding`` metadata ``('pp', None, *inner)``: stage ``s`` owns row ``s``, and
  the layer's own tensor-parallel layout (``inner``) is kept.
* ``__call__`` runs the whole model on one program: pre, the body by ``lax.scan`` over
  the stacked layers, post. :meth:`PipelineLayer.pipeline_loss` trains it: pre on the
  whole batch, then the body and post + ``loss_fn`` through
  :func:`jfleet.parallel.pipeline_schedule.pipeline_loss` (FThenB or 1F1B over the
  ``pp`` axis). ``fleet.distributed_model`` wraps it in a
  :class:`~jfleet.parallel.pipeline_parallel.PipelineParallel` for ``train_batch``.
* :class:`SharedLayerDesc`\\ s with one key share one module (a tied embedding and LM
  head): one parameter, whose gradient sums both uses.
* The activation entering the body may be an array or a tuple (any pytree) of arrays,
  as Paddle's pipelined layers pass ``(hidden, attention_mask, position_ids)``: every body
  layer takes and returns it, and the post layers get it. Its floating arrays go from
  stage to stage and are differentiated; its other arrays (integer position ids, boolean
  masks) reach every stage as per-sample side inputs with their micro-batch and get no
  gradient, so the body layers must return them unchanged. Stacking, running and the
  stage function are :mod:`jfleet.parallel.stack`'s, shared with ``to_distributed``.

Every stage must hold the same number of layers (the stages are one stacked array per
parameter); uneven settings are refused with the settings that would work.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> layers = [LayerDesc(nnx.Linear, 4, 4)] * 4 + [LayerDesc(nnx.Linear, 4, 2)]
  >>> model = PipelineLayer(layers, num_stages=2, seed=0)
  >>> model.body.kernel.shape, model(jnp.ones((3, 4))).shape
  ((2, 2, 4, 4), (3, 2))
"""

from __future__ import annotations

import functools
import inspect
import itertools
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jfleet import _context
from jfleet._logging import logger
from jfleet.amp import cast_floating
from jfleet.engine import scalar_loss
from jfleet.parallel import pipeline_schedule, stack
from jfleet.parallel.mesh_context import layer_mesh
from jfleet.placement import Placement
from jfleet.topology import PP

__all__ = ["LayerDesc", "PipelineLayer", "SharedLayerDesc"]


# ------------------------------------------------------------------ descriptions
class LayerDesc:
    """A layer described now and built later: ``layer_func(*inputs, **kwargs, rngs=rngs)``.

    Args:
      layer_func: the layer class (an ``nnx.Module`` subclass) or a factory returning one.
      *inputs: positional arguments for it.
      **kwargs: keyword arguments for it (``rngs`` is added when it accepts one).

    Raises:
      TypeError: ``layer_func`` is not callable.

    Example:
      >>> from flax import nnx
      >>> desc = LayerDesc(nnx.Linear, 2, 3)
      >>> desc.build_layer(nnx.Rngs(0)).kernel.shape
      (2, 3)
      >>> desc.same_as(LayerDesc(nnx.Linear, 2, 3)), desc.same_as(LayerDesc(nnx.Linear, 3, 2))
      (True, False)
    """

    def __init__(self, layer_func: Callable[..., Any], *inputs: Any, **kwargs: Any) -> None:
        if not callable(layer_func):
            raise TypeError(
                f"LayerDesc(layer_func={layer_func!r}): layer_func must be a layer class or a "
                "function building one."
            )
        self.layer_func = layer_func
        self.inputs = inputs
        self.kwargs = kwargs

    @property
    def name(self) -> str:
        """The class (or factory) name, what ``seg_method='layer:...'`` matches."""
        return _callable_name(self.layer_func)

    def build_layer(self, rngs: nnx.Rngs | None = None) -> Any:
        """Builds the layer, drawing its parameters from ``rngs`` (default ``nnx.Rngs(0)``)."""
        kwargs = dict(self.kwargs)
        if "rngs" not in kwargs and _takes_rngs(self.layer_func):
            kwargs["rngs"] = rngs if rngs is not None else nnx.Rngs(0)
        return self.layer_func(*self.inputs, **kwargs)

    build = build_layer

    def same_as(self, other: Any) -> bool:
        """Whether ``other`` describes the same layer (type, class, arguments all equal)."""
        return (
            type(other) is type(self)
            and other.layer_func is self.layer_func
            and _equal(other.inputs, self.inputs)
            and _equal(other.kwargs, self.kwargs)
        )

    def __repr__(self) -> str:
        args = [repr(a) for a in self.inputs] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{type(self).__name__}({', '.join([self.name, *args])})"


class SharedLayerDesc(LayerDesc):
    """A layer shared by every description with the same ``key`` (a tied weight).

    The first description with a key builds the layer; later ones reuse that very
    module, so the tied parameter is one ``nnx.Param`` and its gradient sums all uses.
    ``forward_func(layer, x)`` says how an occurrence uses the layer (default
    ``layer(x)``): the LM head of a tied embedding is ``lambda emb, x: emb.attend(x)``.

    Args:
      key: the sharing key.
      layer_func: the layer class or factory (as :class:`LayerDesc`).
      forward_func: ``forward_func(layer, x)`` for this occurrence, or None.
      shared_weight_attr: the tied parameter's attribute name on the layer (Paddle's
        argument; checked to exist). ``"weight"`` for jfleet's and Paddle's embeddings,
        ``"embedding"`` for ``nnx.Embed``.
      *inputs: positional arguments for ``layer_func``.
      **kwargs: keyword arguments for ``layer_func``.

    Raises:
      TypeError: ``layer_func`` or ``forward_func`` not callable.

    Example:
      >>> from flax import nnx
      >>> embed = SharedLayerDesc("emb", nnx.Embed, None, "embedding", 16, 4)
      >>> head = SharedLayerDesc("emb", nnx.Embed, lambda e, x: e.attend(x), "embedding", 16, 4)
      >>> model = PipelineLayer([embed, LayerDesc(nnx.Linear, 4, 4), head], num_stages=1)
      >>> model.pre[0].layer is model.post[0].layer
      True
    """

    def __init__(
        self,
        key: Any,
        layer_func: Callable[..., Any],
        forward_func: Callable[[Any, Any], Any] | None = None,
        shared_weight_attr: str = "weight",
        *inputs: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(layer_func, *inputs, **kwargs)
        if forward_func is not None and not callable(forward_func):
            raise TypeError(
                f"SharedLayerDesc(key={key!r}): forward_func={forward_func!r} must be callable "
                "as forward_func(layer, x), or None."
            )
        self.layer_name = key
        self.forward_func = forward_func
        self.shared_weight_attr = shared_weight_attr

    @property
    def key(self) -> Any:
        """The sharing key (Paddle calls it ``layer_name``)."""
        return self.layer_name

    def __repr__(self) -> str:
        return f"SharedLayerDesc(key={self.layer_name!r}, {super().__repr__()})"


class _Run(nnx.Module):
    """One entry of the pre / post part: a layer (maybe through ``forward_func``) or a function."""

    def __init__(self, layer: nnx.Module | None, func: Callable[..., Any] | None) -> None:
        self.layer = layer
        self.func = func

    def __call__(self, x: Any) -> Any:
        if self.layer is None:
            return self.func(x)
        if self.func is None:
            return self.layer(x)
        return self.func(self.layer, x)


# ------------------------------------------------------------------ the layer
class PipelineLayer(nnx.Module):
    """A model as pre layers, a stacked pipelined body and post layers (Paddle's PipelineLayer).

    Args:
      layers: the model in order: :class:`LayerDesc`, :class:`SharedLayerDesc`, built
        ``nnx.Module``\\ s (pre / post only) and parameter-free functions ``f(x)`` (pre /
        post only).
      num_stages: pipeline stages ``P``; default: the fleet's ``pp_degree`` (the
        ``topology``'s ``pipe`` size if given; 1 without ``fleet.init``).
      topology: Paddle's :class:`~jfleet.topology.CommunicateTopology` (only its ``pipe``
        size is read).
      loss_fn: ``loss_fn(output, labels) -> scalar``, the mean loss of a micro-batch;
        a list of them for ``train_batch(loss_fn_idx=...)``. The output is cast to
        float32 first. In training it runs with the post layers inside the pipeline's
        ``shard_map``: use a plain loss such as optax's cross-entropy on the (possibly
        mp-split) logits; functions that open their own ``shard_map`` on the fleet's mesh
        (``ParallelCrossEntropy``) cannot run there yet.
      seg_method: which layers form the body: ``"uniform"`` (the longest run of identical
        consecutive ``LayerDesc``\\ s, split evenly), ``"layer:ClassNameRegex"`` (the
        layers whose class name matches, case-insensitive), or Paddle's explicit stage
        boundaries ``[0, b1, ..., len(layers)]`` over the whole list (each stage must get
        the same number of body layers).
      recompute_interval: ``k > 0`` runs each group of ``k`` layers of a stage under
        ``jax.checkpoint`` (the last group may be shorter).
      recompute_ctx: accepted for Paddle; its process-group settings mean nothing here.
      num_virtual_pipeline_stages: None or 1; interleaved stages are not available yet.
      seed: the seed of the ``nnx.Rngs`` the layers are built with (when ``rngs`` is None).
      rngs: the ``nnx.Rngs`` to build with.

    Attributes:
      pre, post: ``nnx.List``\\ s of the layers before / after the body.
      body: one module of the body's class whose parameters are ``[P, N/P, ...]``.
      num_stages, num_layers, layers_per_stage: ``P``, ``N`` and ``N/P``.
      segment_parts: the stage boundaries over ``layers`` (Paddle's attribute).
      body_range: ``(start, end)``, the body's indices in ``layers``.

    Raises:
      ValueError: no body, an unknown seg_method or one matching nothing (the message
        lists the class names), more stages than body layers, stages of unequal size
        (the message proposes valid settings), or a body layer holding non-``Param``
        state.
      TypeError: malformed ``layers`` entries or arguments.
      NotImplementedError: ``num_virtual_pipeline_stages > 1``.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> descs = [LayerDesc(nnx.Embed, 16, 4)] + [LayerDesc(nnx.Linear, 4, 4)] * 6
      >>> model = PipelineLayer(descs, num_stages=3, seed=0)
      >>> model.num_layers, model.layers_per_stage, model.segment_parts
      (6, 2, (0, 3, 5, 7))
      >>> model(jnp.array([[1, 2, 3]])).shape
      (1, 3, 4)
    """

    def __init__(
        self,
        layers: Sequence[Any],
        num_stages: int | None = None,
        topology: Any = None,
        loss_fn: Callable[..., Any] | Sequence[Callable[..., Any]] | None = None,
        seg_method: str | Sequence[int] = "uniform",
        recompute_interval: int = 0,
        recompute_ctx: Any = None,
        num_virtual_pipeline_stages: int | None = None,
        *,
        seed: int = 0,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        layers = _check_layers(layers)
        if num_virtual_pipeline_stages not in (None, 1):
            raise NotImplementedError(
                f"num_virtual_pipeline_stages={num_virtual_pipeline_stages!r}: interleaved "
                "(virtual) pipeline stages are not available in jfleet yet; leave it None and "
                "use schedule_mode '1F1B' or 'FThenB'."
            )
        if not isinstance(recompute_interval, int) or recompute_interval < 0:
            raise ValueError(
                f"recompute_interval={recompute_interval!r} must be an int >= 0 (0: no "
                "recompute; k: jax.checkpoint over each group of k layers of a stage)."
            )
        if recompute_ctx is not None:
            logger.info("PipelineLayer: recompute_ctx means nothing under SPMD and is ignored")
        stages = _resolve_stages(num_stages, topology)
        self.loss_fns = _check_loss_fns(loss_fn)
        start, end = _find_body(layers, seg_method, stages)
        count = end - start
        self.num_stages = stages
        self.num_layers = count
        self.layers_per_stage = count // stages
        self.recompute_interval = recompute_interval
        self.body_range = (start, end)
        self.segment_parts = tuple(
            [0] + [start + s * self.layers_per_stage for s in range(1, stages)] + [len(layers)]
        )

        rngs = rngs if rngs is not None else nnx.Rngs(seed)
        shared: dict[Any, tuple[SharedLayerDesc, Any]] = {}
        pre = [_build_entry(d, rngs, shared) for d in layers[:start]]
        body = [layers[i].build_layer(rngs) for i in range(start, end)]
        post = [_build_entry(d, rngs, shared) for d in layers[end:]]
        self.pre = nnx.List(pre)
        self.post = nnx.List(post)
        self.body = stack.stack_layers(body, stages, layers[start].name)
        mesh = _context.current_mesh()
        if mesh is not None:
            self.place(mesh)

    # -------------------------------------------------------------- running
    @property
    def loss_fn(self) -> Callable[..., Any] | None:
        """The (first) loss function, or None."""
        return self.loss_fns[0] if self.loss_fns else None

    def get_num_virtual_stages(self) -> int:
        """1: no interleaved stages (Paddle's method)."""
        return 1

    def get_stage_from_index(self, layer_idx: int) -> int:
        """The stage a layer of ``layers`` belongs to (pre layers: 0, post layers: the last)."""
        for stage in range(self.num_stages):
            if layer_idx < self.segment_parts[stage + 1]:
                return stage
        raise ValueError(
            f"layer_idx={layer_idx} is out of range; the model has {self.segment_parts[-1]} layers."
        )

    def place(self, mesh: jax.sharding.Mesh) -> PipelineLayer:
        """Lays the stacked parameters out on ``mesh`` and moves every parameter onto it.

        Sets each body parameter's ``out_sharding`` metadata to ``('pp', None, *inner)``
        (``inner``: the layer's own tensor-parallel layout; ``pp`` only when the mesh's
        ``pp`` size is ``num_stages``) and its ``mesh``, then places the model as its
        metadata says. Done at construction after ``fleet.init``, and by
        ``fleet.distributed_model``.
        """
        self.annotate(mesh)
        Placement(mesh=mesh).place_params(self)
        return self

    def annotate(self, mesh: jax.sharding.Mesh) -> None:
        """Sets the body parameters' ``out_sharding`` and ``mesh`` metadata for ``mesh``."""
        stack.annotate_stack(self.body, mesh, self.num_stages)

    def run_pre(self, inputs: Any) -> Any:
        """The layers before the body."""
        for run in self.pre:
            inputs = run(inputs)
        return inputs

    def run_body(self, x: Any) -> Any:
        """The body's ``N`` layers in order, one ``lax.scan`` over the stacked parameters.

        ``x`` is an array or a pytree such as ``(hidden, mask, position_ids)`` that every
        body layer takes and returns.
        """
        return stack.run_stack(self.body, x, remat_interval=self.recompute_interval)

    def run_post(self, x: Any) -> Any:
        """The layers after the body."""
        for run in self.post:
            x = run(x)
        return x

    def __call__(self, inputs: Any) -> Any:
        """The whole model, sequentially: pre, body, post (no loss)."""
        return self.run_post(self.run_body(self.run_pre(inputs)))

    def loss(self, inputs: Any, labels: Any, *, loss_fn_idx: int = 0) -> jax.Array:
        """``loss_fn(model(inputs), labels)`` run sequentially (the output cast to float32)."""
        return _loss_value(self._loss_fn(loss_fn_idx), self(inputs), labels)

    def pipeline_loss(
        self,
        inputs: Any,
        labels: Any,
        *,
        schedule: str = "1F1B",
        num_microbatches: int = 1,
        mesh: jax.sharding.Mesh | None = None,
        loss_fn_idx: int = 0,
    ) -> jax.Array:
        """The mean micro-batch loss with the body pipelined over the mesh's ``pp`` axis.

        Runs the pre layers on the whole batch, then
        :func:`~jfleet.parallel.pipeline_schedule.pipeline_loss` with one stage = a scan
        over the stage's layers and the head = post layers + ``loss_fn``. Differentiate
        it with ``nnx.grad`` (the engine does): gradients reach every ``nnx.Param``.
        When the pre layers return a tuple such as ``(hidden, mask, position_ids)``, its
        non-floating arrays travel to every stage and to the head as per-sample side
        inputs (see the module docstring).

        Args:
          inputs: the first layer's input, batch first.
          labels: ``loss_fn``'s second argument, batch first.
          schedule: ``"1F1B"`` or ``"FThenB"``.
          num_microbatches: micro-batches ``M``; each data-parallel replica's rows are
            split into ``M`` consecutive micro-batches.
          mesh: the mesh (default: the fleet's); its ``pp`` size must be ``num_stages``.
          loss_fn_idx: which of the loss functions.

        Returns:
          The float32 mean over micro-batches (and data-parallel replicas) of
          ``loss_fn(output, labels)``.

        Raises:
          ValueError: no ``loss_fn``, a mesh whose ``pp`` size is not ``num_stages``,
            and :func:`~jfleet.parallel.pipeline_schedule.pipeline_loss`'s errors.
        """
        loss_fn = self._loss_fn(loss_fn_idx)
        mesh = layer_mesh(mesh)
        size = mesh.shape.get(PP, 1)
        if size != self.num_stages:
            raise ValueError(
                f"the PipelineLayer has num_stages={self.num_stages} but the mesh's {PP!r} axis "
                f"has size {size}; build it with num_stages={size} (pp_degree)."
            )
        x = self.run_pre(inputs)
        split, carried, side, shared = stack.stage_inputs(x)
        body_def, body_state = nnx.split(self.body)
        post_def, post_params, post_rest = nnx.split(self.post, nnx.Param, ...)
        stage_params = nnx.to_pure_dict(body_state)
        head_params = nnx.to_pure_dict(post_params)
        stage_fn = stack.stage_function(body_def, split, remat_interval=self.recompute_interval)

        def head_fn(params: Any, y: list, target: tuple) -> jax.Array:
            labels, side = target
            post = nnx.merge(post_def, params, post_rest)
            out = split.activation_of(y, side)
            for run in post:
                out = run(out)
            return _loss_value(loss_fn, out, labels)

        # On CPU half-precision values cross the pipeline in float32 (stack.widened_stage).
        wide = stack.widens_on(mesh)
        stage_fn, stage_params, carried_in = stack.widened_stage(
            stage_fn, stage_params, carried, mesh=mesh
        )
        return pipeline_schedule.pipeline_loss(
            stage_fn,
            stack.widened(head_fn, (head_params, carried), wide=wide),
            stage_params,
            stack.widen(head_params, wide),
            carried_in,
            (labels, side),  # the head rebuilds the body's output from its side leaves
            side,
            shared,
            mesh=mesh,
            schedule=schedule,
            num_microbatches=num_microbatches,
        )

    def _loss_fn(self, idx: int) -> Callable[..., Any]:
        if not self.loss_fns:
            raise ValueError(
                "the PipelineLayer has no loss_fn; build it with PipelineLayer(..., "
                "loss_fn=lambda output, labels: scalar_loss)."
            )
        if not isinstance(idx, int) or not 0 <= idx < len(self.loss_fns):
            raise ValueError(
                f"loss_fn_idx={idx!r} is out of range: the PipelineLayer has "
                f"{len(self.loss_fns)} loss function(s)."
            )
        return self.loss_fns[idx]


# ------------------------------------------------------------------ running helpers
def _loss_value(loss_fn: Callable[..., Any], output: Any, labels: Any) -> jax.Array:
    return scalar_loss(
        loss_fn(cast_floating(output, jnp.float32), labels), "loss_fn(output, labels)"
    )


# ------------------------------------------------------------------ building helpers
def _callable_name(fn: Any) -> str:
    if isinstance(fn, functools.partial):
        return _callable_name(fn.func)
    return getattr(fn, "__name__", type(fn).__name__)


def _entry_name(entry: Any) -> str:
    if isinstance(entry, LayerDesc):
        return entry.name
    if isinstance(entry, nnx.Module):
        return type(entry).__name__
    return _callable_name(entry)


def _takes_rngs(fn: Any) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return "rngs" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _equal(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        same = a == b
    except Exception:  # arrays and other objects without a plain ==
        return False
    return same if isinstance(same, bool | np.bool_) else False


def _check_layers(layers: Any) -> list[Any]:
    if isinstance(layers, nnx.Module) or not isinstance(layers, Sequence | nnx.List):
        raise TypeError(
            f"layers must be a list of LayerDesc / SharedLayerDesc / nnx.Module / functions; "
            f"got {type(layers).__name__}."
        )
    layers = list(layers)
    if not layers:
        raise ValueError("layers is empty; pass the model's layers as a list of LayerDesc.")
    bad = [
        f"{i}: {entry!r}"
        for i, entry in enumerate(layers)
        if not (isinstance(entry, LayerDesc | nnx.Module) or callable(entry))
    ]
    if bad:
        raise TypeError(
            "layers entries must be LayerDesc, SharedLayerDesc, nnx.Module or functions; "
            f"these are not: {'; '.join(bad)}."
        )
    return layers


def _check_loss_fns(loss_fn: Any) -> tuple[Callable[..., Any], ...]:
    if loss_fn is None:
        return ()
    fns = tuple(loss_fn) if isinstance(loss_fn, list | tuple) else (loss_fn,)
    bad = [repr(f) for f in fns if not callable(f)]
    if bad or not fns:
        raise TypeError(
            f"loss_fn={loss_fn!r} must be a callable loss_fn(output, labels) (or a list of them)."
        )
    return fns


def _resolve_stages(num_stages: Any, topology: Any) -> int:
    from_topology = None
    if topology is not None:
        if not hasattr(topology, "get_dim"):
            raise TypeError(
                f"topology={topology!r} is not a CommunicateTopology; pass "
                "fleet.get_hybrid_parallel_topology() or None."
            )
        from_topology = int(topology.get_dim("pipe"))
    if num_stages is None:
        if from_topology is not None:
            return from_topology
        run = _context.current()
        return run.hcg.get_pipe_parallel_world_size() if run is not None else 1
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r} must be an int >= 1.")
    if from_topology is not None and from_topology != num_stages:
        raise ValueError(
            f"num_stages={num_stages} disagrees with the topology's pipe degree "
            f"{from_topology}; pass one of them."
        )
    return num_stages


def _runs(layers: list[Any]) -> list[tuple[int, int]]:
    """Maximal runs ``(start, end)`` of identical consecutive plain ``LayerDesc``\\ s."""
    runs, i = [], 0
    while i < len(layers):
        if type(layers[i]) is not LayerDesc:
            i += 1
            continue
        j = i + 1
        while j < len(layers) and layers[i].same_as(layers[j]):
            j += 1
        runs.append((i, j))
        i = j
    return runs


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _find_body(layers: list[Any], seg_method: Any, stages: int) -> tuple[int, int]:
    """The body's ``(start, end)`` in ``layers``, after checking every stage gets as many."""
    names = [_entry_name(e) for e in layers]
    if isinstance(seg_method, str) and seg_method.startswith("layer:"):
        pattern = seg_method[len("layer:") :]
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as err:
            raise ValueError(f"seg_method={seg_method!r}: bad regular expression ({err}).") from err
        hits = [i for i, name in enumerate(names) if regex.search(name)]
        if not hits:
            raise ValueError(
                f"seg_method={seg_method!r} matches no layer; the layers' class names are "
                f"{sorted(set(names))}."
            )
        start, end = hits[0], hits[-1] + 1
        if hits != list(range(start, end)) or not any(r == (start, end) for r in _runs(layers)):
            raise ValueError(
                f"seg_method={seg_method!r} matches the layers at {hits} "
                f"({[names[i] for i in hits]}); the pipelined body must be one run of identical "
                "consecutive LayerDescs (same class and arguments), with nothing else matching."
            )
        parts = None
    elif isinstance(seg_method, str):
        if seg_method != "uniform":
            raise ValueError(
                f"seg_method={seg_method!r} is not a segmentation method; use 'uniform', "
                "'layer:ClassNameRegex' or a list of stage boundaries [0, ..., len(layers)]."
            )
        runs = _runs(layers)
        if not runs:
            raise ValueError(
                f"layers {names} have no LayerDesc to pipeline; describe the repeated blocks "
                "with LayerDesc(cls, *args, **kwargs)."
            )
        start, end = max(runs, key=lambda r: (r[1] - r[0], -r[0]))
        parts = None
    else:
        start, end = max(_runs(layers) or [(0, 0)], key=lambda r: (r[1] - r[0], -r[0]))
        parts = _explicit_parts(seg_method, len(layers), stages, start, end)

    count = end - start
    body = f"{names[start]} layers" if count else "layers"
    if count < stages:
        raise ValueError(
            f"num_stages={stages} is more than the {count} pipelined {body} (the body: "
            f"layers[{start}:{end}]); use num_stages (pp_degree) in {_divisors(count) or [1]}, "
            "or more layers."
        )
    if parts is None:
        base, rem = divmod(count, stages)
        parts = [base] * (stages - rem) + [base + 1] * rem  # Paddle: remainder to the last
    if len(set(parts)) > 1:
        lower, upper = count - count % stages, count + stages - count % stages
        raise ValueError(
            f"seg_method={seg_method!r} puts {parts} {body} on the {stages} stages; jfleet "
            f"stacks the stages into one array per parameter and needs the same number on "
            f"each. Use num_stages (pp_degree) in {_divisors(count)} (those dividing {count}), "
            f"or a body of {lower or stages} or {upper} layers."
        )
    return start, end


def _explicit_parts(bounds: Any, n: int, stages: int, start: int, end: int) -> list[int]:
    """Body layers per stage for Paddle's explicit boundaries ``[0, b1, ..., n]``."""
    ok = isinstance(bounds, Sequence) and all(
        isinstance(b, int) and not isinstance(b, bool) for b in bounds
    )
    if not ok:
        raise TypeError(
            f"seg_method={bounds!r} must be 'uniform', 'layer:ClassNameRegex' or a list of ints."
        )
    bounds = list(bounds)
    if (
        len(bounds) != stages + 1
        or bounds[0] != 0
        or bounds[-1] != n
        or any(b > c for b, c in itertools.pairwise(bounds))
    ):
        raise ValueError(
            f"seg_method={bounds} must be {stages + 1} non-decreasing stage boundaries from 0 "
            f"to {n} (num_stages={stages}, {n} layers)."
        )
    return [max(0, min(b, end) - max(a, start)) for a, b in itertools.pairwise(bounds)]


def _build_entry(entry: Any, rngs: nnx.Rngs, shared: dict) -> _Run:
    if isinstance(entry, SharedLayerDesc):
        if entry.key in shared:
            first, layer = shared[entry.key]
            if first.layer_func is not entry.layer_func:
                raise ValueError(
                    f"SharedLayerDesc key {entry.key!r} is used with {first.name} and "
                    f"{entry.name}; descriptions sharing a key must build the same layer."
                )
        else:
            layer = entry.build_layer(rngs)
            if not hasattr(layer, entry.shared_weight_attr):
                params = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(layer))]
                raise ValueError(
                    f"SharedLayerDesc key {entry.key!r}: {entry.name} has no attribute "
                    f"shared_weight_attr={entry.shared_weight_attr!r}; its parameters: {params}."
                )
            shared[entry.key] = (entry, layer)
        return _Run(layer, entry.forward_func)
    if isinstance(entry, LayerDesc):
        return _Run(entry.build_layer(rngs), None)
    if isinstance(entry, nnx.Module):
        return _Run(entry, None)
    return _Run(None, entry)
