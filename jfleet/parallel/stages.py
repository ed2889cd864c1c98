"""Pipeline stages that hold different layers: per-dtype flat buffers, one row per stage.

When the stages of a :class:`~jfleet.parallel.pipeline_layer.PipelineLayer` are not the
same stacked layers (stage 0 = embedding + 2 blocks and stage 1 = 3 blocks + norm +
head; four different layer types; a parameter-free stage), :class:`FlatStages` holds them:

* each stage's layers (an ``nnx.List`` of :class:`Run`\\ s) are split into a graph
  definition and parameters; the parameters are raveled and concatenated per dtype, padded
  with zeros to the largest stage and stacked to one ``[P, n]`` ``nnx.Param`` per dtype,
  sharded on ``pp``: a device holds its own stage's row (the largest stage's size);
* :meth:`FlatStages.run` rebuilds stage ``s``'s layers from its row (static slices and
  reshapes: gradients flow back into the row) and runs a range of them, optionally under
  ``jax.checkpoint`` every ``k`` layers; inside the pipeline's ``shard_map`` each device
  picks its stage with ``lax.switch`` on its ``pp`` index (:meth:`FlatStages.switch`).

The layers themselves stay in the model as ``templates`` whose parameters are
:class:`Slot` placeholders, so settings applied to the model after it is built (AMP
compute dtypes, recompute flags) reach them. Tied layers
(:class:`~jfleet.parallel.pipeline_layer.SharedLayerDesc`) stay out of the buffers: a
:class:`Run` names them by key and gets the module from the caller.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> stages = FlatStages([[Run(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))],
  ...                      [Run(nnx.LayerNorm(3, rngs=nnx.Rngs(1))), Run(None, jnp.tanh)]])
  >>> stages.flat["float32"].shape  # Linear: 6 + 3; LayerNorm: 3 + 3, padded to 9
  (2, 9)
  >>> stages(jnp.ones((4, 2))).shape
  (4, 3)
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jfleet.mesh.topology import PP
from jfleet.parallel.stack import check_params_only

__all__ = ["FlatStages", "ParamView", "Run", "Slot", "params_in_order"]


def params_in_order(node: Any, path: tuple = ()) -> list[tuple[tuple, nnx.Param]]:
    """``(path, param)`` of a module's parameters in attribute order (Paddle's
    ``parameters()`` order; ``nnx`` sorts attribute names), each once.

    Example:
      >>> import jax.numpy as jnp
      >>> class Net(nnx.Module):
      ...     def __init__(self):
      ...         self.w, self.b = nnx.Param(jnp.ones(2)), nnx.Param(jnp.zeros(1))
      >>> [p for p, _ in params_in_order(Net())]
      [('w',), ('b',)]
    """
    out, seen = [], set()

    def walk(value: Any, path: tuple) -> None:
        if id(value) in seen:
            return
        if isinstance(value, nnx.Param):
            seen.add(id(value))
            out.append((path, value))
        elif isinstance(value, nnx.Module):
            seen.add(id(value))
            for name, item in vars(value).items():
                if not name.startswith(("_pytree__", "_object__")):
                    walk(item, (*path, name))
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                walk(item, (*path, str(i)))
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, (*path, str(key)))

    walk(node, path)
    return out


class ParamView:
    """One layer's parameter inside a stacked or flat stage buffer (``parameters()``'s items).

    ``view[...]`` reads it, ``view.set_value(value)`` writes it in place (Paddle's
    ``param.set_value``), keeping the buffer's sharding.

    Args:
      var: the buffer's ``nnx.Param``.
      index: where the parameter is in the buffer (ints and slices).
      shape: the parameter's shape.
    """

    def __init__(self, var: nnx.Param, index: tuple, shape: tuple[int, ...]) -> None:
        self.var, self.index, self.shape = var, index, tuple(shape)

    @property
    def dtype(self) -> Any:
        return self.var[...].dtype

    def __getitem__(self, key: Any) -> jax.Array:
        return self.var[...][self.index].reshape(self.shape)[key]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self[...], dtype=dtype)

    def numpy(self) -> np.ndarray:
        return np.asarray(self)

    def set_value(self, value: Any) -> None:
        """Writes ``value`` (of the parameter's size) into the buffer."""
        old = self.var[...]
        part = jnp.asarray(value, old.dtype)
        if part.size != int(np.prod(self.shape)):
            raise ValueError(
                f"set_value got shape {part.shape} for a parameter of shape {self.shape}."
            )
        new = old.at[self.index].set(part.reshape(old[self.index].shape))
        self.var[...] = jax.device_put(new, old.sharding)

    def __repr__(self) -> str:
        return f"ParamView({self.dtype}{list(self.shape)})"


class Run(nnx.Module):
    """One layer of a pipeline: a module (maybe through ``func(layer, x)``), a function, or a
    tied layer named by ``key``.

    Args:
      layer: the module, or None.
      func: ``func(x)`` without a module, ``func(layer, x)`` with one, or None.
      key: the tied layer's key (the module is passed to ``__call__``), or None.
    """

    def __init__(
        self, layer: nnx.Module | None, func: Callable[..., Any] | None = None, key: Any = None
    ) -> None:
        self.layer = layer
        self.func = func
        self.key = key

    def __call__(self, x: Any, shared: Mapping[str, nnx.Module] | None = None) -> Any:
        layer = self.layer if self.key is None else shared[self.key]
        if layer is None:
            return self.func(x)
        if self.func is None:
            return layer(x)
        return self.func(layer, x)


class Slot(nnx.Variable):
    """Where a stage layer's parameter lives in its stage's buffer (a placeholder)."""


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _slot(var: nnx.Variable) -> Slot:
    return Slot(jnp.zeros((), jnp.int8))


def _signature(x: Any) -> tuple:
    leaves, treedef = jax.tree.flatten(x)
    return treedef, tuple((tuple(a.shape), jnp.dtype(a.dtype).name) for a in leaves)


def _show(signature: tuple) -> str:
    return str([f"{dtype}{list(shape)}" for shape, dtype in signature[1]])


def _path_key(path: tuple) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in path)


def _dtype_key(dtype: Any) -> str:
    return jnp.dtype(dtype).name


def _stacked(rows: Sequence[Mapping[str, jax.Array]]) -> dict[str, nnx.Param]:
    """Per dtype, the stages' rows padded with zeros to the longest and stacked ``[P, n]``."""
    widths = {k: max(r[k].size for r in rows if k in r) for r in rows for k in r}
    flat = {}
    for key, width in sorted(widths.items()):
        padded = [
            jnp.pad(r[key], (0, width - r[key].size)) if key in r else jnp.zeros(width, key)
            for r in rows
        ]
        flat[key] = nnx.Param(jnp.stack(padded))
    return flat


class FlatStages(nnx.Module):
    """``P`` stages of different layers, their parameters in ``[P, n]`` buffers per dtype.

    Args:
      stages: per stage, its :class:`Run`\\ s in order (a stage may be empty).

    Attributes:
      flat: ``nnx.Dict`` from dtype name to the ``[P, n]`` ``nnx.Param`` buffer.
      num_stages: ``P``.
      sizes: per stage, its number of parameters (before padding).
      sharded: ``(stage, layer, path)`` of the parameters with a tensor-parallel layout
        (``out_sharding``), which the buffers do not keep.

    Raises:
      ValueError: a stage layer holding state other than ``nnx.Param``.
    """

    def __init__(self, stages: Sequence[Sequence[Run]]) -> None:
        recipes, rows, sizes, orders, templates, sharded = [], [], [], [], [], []
        slot_paths = []
        for s, runs in enumerate(stages):
            modules = nnx.List(list(runs))
            check_params_only(modules, f"pipeline stage {s}'s layers")
            graphdef, state = nnx.split(modules)
            sharded += [
                (s, int(path[0]), ".".join(map(str, path[2:])))
                for path, var in nnx.to_flat_state(state)
                if any(var.get_metadata("out_sharding", None) or ())
            ]
            paths, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))
            leaves = [leaf for _, leaf in paths]
            slot_paths.append(tuple(tuple(getattr(k, "key", k) for k in p) for p, _ in paths))
            where = {_path_key(path): i for i, (path, _) in enumerate(paths)}
            orders.append(tuple(where[path] for path, _ in params_in_order(modules)))
            offsets: dict[str, int] = collections.defaultdict(int)
            parts: dict[str, list] = collections.defaultdict(list)
            slots = []
            for leaf in leaves:
                key = _dtype_key(leaf.dtype)
                slots.append((key, offsets[key], int(leaf.size), tuple(leaf.shape)))
                offsets[key] += int(leaf.size)
                parts[key].append(jnp.ravel(leaf))
            recipes.append((treedef, tuple(slots)))
            templates.append(nnx.merge(graphdef, jax.tree.map(_slot, state, is_leaf=_is_var)))
            rows.append({k: jnp.concatenate(v) for k, v in parts.items()})
            sizes.append(sum(int(leaf.size) for leaf in leaves))
        self.flat = nnx.Dict(_stacked(rows))
        self._slot_paths = tuple(slot_paths)  # per stage, each slot's path in its layers
        self.num_stages = len(recipes)
        self.sizes = tuple(sizes)
        self.lengths = tuple(len(r) for r in stages)
        self._recipes = tuple(recipes)
        # the stages' layers with placeholders for their parameters: settings applied to the
        # model later (AMP compute dtypes, recompute) reach them
        self.templates = nnx.List(templates)
        self._orders = tuple(orders)  # per stage, its slots in attribute (Paddle's) order
        self.sharded = tuple(sharded)  # tensor-parallel parameters (laid out on mesh axes)

    def cast_held_params(self, dtype: Any, keep: Callable[[tuple], bool]) -> None:
        """AMP O2 on the stage layers: casts each floating parameter to ``dtype`` unless
        ``keep(path)`` (its path under this module: ``("templates", s, layer, ...)``, e.g. a
        norm's), regrouping the buffers by the new dtypes.

        :class:`jfleet.amp.AmpPolicy` calls this instead of casting the buffers whole, so a
        norm layer on a stage keeps fp32 parameters as it does unpipelined.
        """
        meta = {}  # the buffers' layout (set by annotate), the same on each
        for var in self.flat.values():
            held = var.get_metadata()
            meta = {k: held[k] for k in ("out_sharding", "mesh") if k in held}
        half = jnp.dtype(dtype)
        recipes, rows = [], []
        for s, (treedef, slots) in enumerate(self._recipes):
            old = self.rows(s)
            offsets: dict[str, int] = collections.defaultdict(int)
            parts: dict[str, list] = collections.defaultdict(list)
            new_slots = []
            for (key, offset, size, shape), path in zip(slots, self._slot_paths[s], strict=True):
                leaf = old[key][offset : offset + size]
                if jnp.issubdtype(leaf.dtype, jnp.floating) and not keep(("templates", s, *path)):
                    leaf = leaf.astype(half)
                new_key = _dtype_key(leaf.dtype)
                new_slots.append((new_key, offsets[new_key], size, shape))
                offsets[new_key] += size
                parts[new_key].append(leaf)
            recipes.append((treedef, tuple(new_slots)))
            rows.append({k: jnp.concatenate(v) for k, v in parts.items()})
        self._recipes = tuple(recipes)
        flat = _stacked(rows)
        for var in flat.values():
            if meta:
                var.set_metadata(**meta)
        self.flat = nnx.Dict(flat)

    def parameters(self, s: int) -> list[ParamView]:
        """Stage ``s``'s parameters as views into its buffer row, layer by layer in
        attribute order (tied layers, held outside, excluded)."""
        slots = self._recipes[s][1]
        views = []
        for i in self._orders[s]:
            key, offset, size, shape = slots[i]
            views.append(ParamView(self.flat[key], (s, slice(offset, offset + size)), shape))
        return views

    def annotate(self, mesh: jax.sharding.Mesh) -> None:
        """Sets the buffers' ``out_sharding`` to ``(pp, None)`` (when the mesh's ``pp`` size is
        the stage count) and their ``mesh``."""
        stage_axis = PP if mesh.shape.get(PP, 1) == self.num_stages else None
        for var in self.flat.values():
            var.set_metadata(out_sharding=(stage_axis, None), mesh=mesh)

    def rows(self, s: int) -> dict[str, jax.Array]:
        """Stage ``s``'s buffers ``{dtype: [n]}`` (slices of the ``[P, n]`` parameters)."""
        return {k: v[...][s] for k, v in self.flat.items()}

    def layers(self, s: int, rows: Mapping[str, jax.Array]) -> nnx.List:
        """Stage ``s``'s :class:`Run`\\ s rebuilt from its buffers ``rows``."""
        treedef, slots = self._recipes[s]
        graphdef = nnx.graphdef(self.templates[s])
        leaves = [rows[k][o : o + n].reshape(shape) for k, o, n, shape in slots]
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

    def run(
        self,
        s: int,
        rows: Mapping[str, jax.Array],
        x: Any,
        *,
        start: int = 0,
        stop: int | None = None,
        shared: Mapping[str, nnx.Module] | None = None,
        remat_interval: int = 0,
    ) -> Any:
        """Stage ``s``'s layers ``start:stop`` on ``x``, from its buffers ``rows``.

        With ``remat_interval = k > 0`` each group of ``k`` layers that holds parameters
        runs under ``jax.checkpoint`` (Paddle's recompute of a stage's layers).
        """
        stop = self.lengths[s] if stop is None else stop
        order = list(range(start, stop))
        groups = [order] if remat_interval <= 0 else [
            order[i : i + remat_interval] for i in range(0, len(order), remat_interval)
        ]  # fmt: skip
        sized = self._sized(s)
        for group in groups:

            def chunk(rows: Any, x: Any, group: list = group) -> Any:
                layers = self.layers(s, rows)
                for i in group:
                    x = layers[i](x, shared)
                return x

            needs = remat_interval > 0 and any(sized[i] for i in group)
            x = jax.checkpoint(chunk)(rows, x) if needs else chunk(rows, x)
        return x

    def switch(self, rows: Mapping[str, jax.Array], x: Any, ranges: Sequence[tuple[int, int]],
               *, remat_interval: int = 0, axis: str = PP) -> Any:  # fmt: skip
        """Inside a ``shard_map`` over ``axis``: this device's stage on ``x`` (``lax.switch``).

        ``ranges[s]`` is the ``(start, stop)`` of stage ``s``'s layers to run.
        """
        branches = [
            (lambda rows, x, s=s: self.run(
                s, rows, x, start=ranges[s][0], stop=ranges[s][1], remat_interval=remat_interval))
            for s in range(self.num_stages)
        ]  # fmt: skip
        return lax.switch(lax.axis_index(axis), branches, rows, x)

    def __call__(
        self, x: Any, shared: Mapping[str, nnx.Module] | None = None, *, remat_interval: int = 0
    ) -> Any:
        """Every stage in order, on one program (the sequential model)."""
        for s in range(self.num_stages):
            x = self.run(s, self.rows(s), x, shared=shared, remat_interval=remat_interval)
        return x

    def ends(self, parts: Sequence[int], inputs: Any, shared: Any = None) -> tuple[int, int]:
        """``(k, j)``: stage 0's layers ``[0, k)`` run before the pipeline and the last stage's
        layers ``[j, n)`` in its head (global indices over the stages' ``parts``); between,
        the activation has the shape the stages exchange.

        Raises:
          ValueError: the stages exchange activations of different shapes.
        """
        n = parts[-1]
        if len(parts) == 2:  # one stage: all of it runs before the (one-stage) pipeline
            return n, n
        signatures = []

        def walk(flat: Any, x: Any) -> int:
            signatures.append(_signature(x))
            for s in range(self.num_stages):
                for run in self.layers(s, {k: v[s] for k, v in flat.items()}):
                    x = run(x, shared)
                    signatures.append(_signature(x))
            return 0

        jax.eval_shape(walk, {k: v[...] for k, v in self.flat.items()}, inputs)
        sent = [signatures[b] for b in parts[1:-1]]
        if any(sig != sent[0] for sig in sent):
            shown = "; ".join(
                f"after layer {b - 1}: {_show(sig)}"
                for b, sig in zip(parts[1:-1], sent, strict=True)
            )
            raise ValueError(
                f"the stages (boundaries seg_method -> {list(parts)}) pass activations of "
                f"different shapes ({shown}); the pipeline sends one activation shape from "
                "stage to stage: choose boundaries after layers that return the same shape "
                "(seg_method=[0, ...])."
            )
        k = next(i for i in range(parts[1] + 1) if signatures[i] == sent[0])
        j = next(i for i in range(n, parts[-2] - 1, -1) if signatures[i] == sent[0])
        return k, j

    def pipeline_parts(
        self,
        parts: Sequence[int],
        inputs: Any,
        shared: Any,
        shared_at: Sequence[int] = (),
        *,
        remat_interval: int = 0,
        tensor_parallel: int = 1,
    ) -> tuple:
        """What a pipelined loss needs: ``(x, run_stage, stage_params, last_rows, post,
        tied, pre)``: the activation after :meth:`ends`' first layers (``pre(inputs)``),
        the stage function ``run_stage(rows, x)`` (:meth:`switch`), the ``[P, n]``
        buffers, the last stage's rows and ``post(rows, out, tied)`` for its head.

        Raises:
          ValueError: a tied layer (index in ``shared_at``) inside the pipelined layers;
            :meth:`ends`' errors.
          NotImplementedError: tensor-parallel layers inside the pipelined layers with
            ``tensor_parallel`` (the mp degree) > 1.
        """
        k, j = self.ends(parts, inputs, shared)
        inside = [f"layer {parts[s] + i}: {path}" for s, i, path in self.sharded
                  if k <= parts[s] + i < j]  # fmt: skip
        if inside and tensor_parallel > 1:
            raise NotImplementedError(
                f"stages of different layers (boundaries {list(parts)}) run tensor-parallel "
                f"parameters ({'; '.join(inside[:2])}, ...) at mp={tensor_parallel}: each "
                "device runs its own stage's branch, and the collectives of one stage's "
                "branch would wait for the other stages. Split identical blocks evenly "
                "(seg_method='layer:BlockName': the stacked body keeps their layout) or use "
                "mp_degree=1."
            )
        p = self.num_stages
        ranges = [(max(a, k) - a, min(b, j) - a) for a, b in itertools.pairwise(parts)]
        inside = [i for i in shared_at if k <= i < j]
        if inside:
            raise ValueError(
                f"layers {inside} are SharedLayerDescs inside pipelined stages (the stages run "
                f"layers {k} to {j - 1}); jfleet ties layers only at the ends (the embedding "
                "and the LM head): keep tied layers first and last, or describe them with "
                "LayerDesc."
            )

        def pre(inputs: Any) -> Any:
            return self.run(0, self.rows(0), inputs, stop=k, shared=shared)

        def run_stage(rows: Any, x: Any) -> Any:
            return self.switch(rows, x, ranges, remat_interval=remat_interval)

        def post(rows: Any, out: Any, tied: Any) -> Any:
            return self.run(p - 1, rows, out, start=j - parts[-2], shared=tied)

        flat = {key: v[...] for key, v in self.flat.items()}
        return pre(inputs), run_stage, flat, self.rows(p - 1), post, shared, pre

    def _sized(self, s: int) -> list[bool]:
        """Per layer of stage ``s``, whether it holds parameters."""
        treedef, slots = self._recipes[s]
        leaves = [np.zeros((), np.int8)] * len(slots)
        pure = jax.tree.unflatten(treedef, leaves)
        return [bool(jax.tree.leaves(pure.get(i, {}))) for i in range(self.lengths[s])]
