"""Assertions for your own parallel code: trains like one device, placed and compiled as meant.

* :func:`assert_trains_like_one_device`: the model trained under a layout (a forced mesh,
  a :class:`~jfleet.auto_parallel.ToDistributedConfig`, a Fleet strategy or your own
  training function) gives the single-device run's losses and final parameters; a failure
  names the first step whose loss diverges and the parameters that differ.
* :func:`assert_sharded_as`: every array whose path matches a pattern has that
  ``PartitionSpec``.
* :func:`assert_collectives` / :func:`assert_peak_memory_below`: the compiled step's
  collectives (counted by :mod:`jfleet.testing.hlo`, loop bodies weighted by their trip
  counts) and its memory per device (``memory_analysis()``).

Example:
  >>> import jax, jax.numpy as jnp
  >>> step = jax.jit(lambda x: x * 2)
  >>> _ = assert_collectives(step, jnp.ones(4), expected={"all-reduce": 0})
  >>> assert_peak_memory_below(step, 1 << 20, jnp.ones(4)) < 1 << 20
  True
"""

from __future__ import annotations

import dataclasses
import fnmatch
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet import fleet
from jfleet.auto_parallel.to_distributed import ToDistributedConfig, get_plan, to_distributed
from jfleet.testing import hlo
from jfleet.testing.devices import require_devices
from jfleet.testing.reference import train_one_device
from jfleet.testing.trees import default_tolerance, leaf_scale, state_as_numpy
from jfleet.training.engine import make_train_step
from jfleet.training.strategy import DistributedStrategy

__all__ = [
    "assert_collectives",
    "assert_peak_memory_below",
    "assert_sharded_as",
    "assert_trains_like_one_device",
    "default_tolerance",
]

#: ``trainer(model, optimizer, batches, loss_fn) -> losses``, training ``model`` in place.
Trainer = Callable[[nnx.Module, optax.GradientTransformation, list, Callable], Sequence[float]]
Layout = Mapping[str, int] | ToDistributedConfig | DistributedStrategy | Trainer


# --------------------------------------------------------------- trains like one device


def _describe(layout: Any) -> str:
    if isinstance(layout, Mapping):
        return "forced mesh " + " x ".join(f"{a}{d}" for a, d in layout.items())
    if isinstance(layout, ToDistributedConfig):
        mesh = layout.force_mesh
        return f"to_distributed ({'mesh ' + str(dict(mesh)) if mesh else 'planned mesh'})"
    if isinstance(layout, DistributedStrategy):
        degrees = {k: v for k, v in layout.hybrid_configs.items() if k.endswith("_degree")}
        return "strategy " + " x ".join(f"{k[:-7]}{v}" for k, v in degrees.items() if v != 1)
    return f"trainer {getattr(layout, '__qualname__', repr(layout))}"


def _train_distributed(
    model_fn: Callable[[], nnx.Module],
    optimizer: optax.GradientTransformation,
    batches: list,
    loss_fn: Callable,
    layout: Layout,
) -> tuple[list[float], dict[str, Any], nnx.Module]:
    """Trains a fresh model under ``layout``: losses, logical leaves, the model as built."""
    if isinstance(layout, Mapping):
        layout = ToDistributedConfig(force_mesh=dict(layout))
    if isinstance(layout, ToDistributedConfig):
        if layout.forward is None and layout.loss_fn is None:
            layout = dataclasses.replace(layout, loss_fn=loss_fn)  # trace what trains
        device_num = _devices_needed(layout)
        built = model_fn()
        initial = _params(built)
        model, opt, loader = to_distributed(
            built, optimizer, batches, device_num=device_num, config=layout
        )
        step = make_train_step(loss_fn)
        losses = [float(step(model, opt, batch)) for batch in loader]
        # gradient accumulation: k calls on equal slices per batch; their mean loss is
        # the batch's (the loss a mean over equal slices)
        k = get_plan(model).layout.accumulate_steps
        losses = [float(np.mean(losses[i : i + k])) for i in range(0, len(losses), k)]
        return losses, _params(model), initial
    if isinstance(layout, DistributedStrategy):
        fleet.init(is_collective=True, strategy=layout, log_level="WARNING")
        built = model_fn()
        initial = _params(built)
        model = fleet.distributed_model(built)
        opt = fleet.distributed_optimizer(optimizer)
        step = make_train_step(loss_fn)
        losses = [float(step(model, opt, batch)) for batch in batches]
        return losses, _params(model), initial
    if callable(layout):
        model = model_fn()
        initial = _params(model)
        losses = [float(x) for x in layout(model, optimizer, batches, loss_fn)]
        return losses, _params(model), initial
    raise TypeError(
        f"layout={layout!r}: expected degrees ({{'dp': 2, 'mp': 4}}), a ToDistributedConfig, "
        "a DistributedStrategy or a trainer(model, optimizer, batches, loss_fn) -> losses."
    )


def _devices_needed(layout: Any) -> int | None:
    """The devices a forced mesh or a strategy's degrees multiply to (None: any count)."""
    if isinstance(layout, Mapping):
        return math.prod(layout.values())
    if isinstance(layout, ToDistributedConfig) and layout.force_mesh:
        return math.prod(layout.force_mesh.values())
    if isinstance(layout, DistributedStrategy):
        degrees = [v for k, v in layout.hybrid_configs.items() if k.endswith("_degree")]
        return math.prod(d for d in degrees if d > 0)
    return None


_params = state_as_numpy


def _leaf_report(got: dict[str, Any], want: dict[str, Any], rtol: float, atol: float) -> list[str]:
    """One line per leaf that differs (missing, extra, shape or values), in model order.

    ``atol`` is relative to the leaf's magnitude: ``atol * max(1, max |want|)``.
    """
    lines = [f"'{k}': missing from the parallel run" for k in want if k not in got]
    lines += [f"'{k}': only in the parallel run" for k in got if k not in want]
    for key in (k for k in want if k in got):
        a = np.asarray(got[key], np.float32)
        b = np.asarray(want[key], np.float32)
        if a.shape != b.shape:
            lines.append(f"'{key}': shape {a.shape}, want {b.shape}")
            continue
        bad = ~np.isclose(a, b, rtol=rtol, atol=atol * leaf_scale(b))
        bad |= np.isfinite(a) != np.isfinite(b)
        if bad.any():
            diff = np.where(np.isfinite(a - b), np.abs(a - b), np.inf)
            at = np.unravel_index(int(np.argmax(diff)), a.shape) if a.ndim else ()
            lines.append(
                f"'{key}': {int(bad.sum())} of {a.size} values differ, max |diff| "
                f"{float(diff[at]):.3g} at {tuple(int(i) for i in at)} "
                f"(got {float(a[at]):.6g}, want {float(b[at]):.6g})"
            )
    return lines


def assert_trains_like_one_device(
    model_fn: Callable[[], nnx.Module],
    optimizer: optax.GradientTransformation,
    batches: Iterable[Any],
    *,
    loss_fn: Callable[[nnx.Module, Any], jax.Array],
    layout: Layout,
    steps: int | None = None,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Training under ``layout`` gives one device's per-step losses and final parameters.

    Builds the model twice with ``model_fn`` (which must give equal parameters each call:
    seed it), trains one copy on the first device (:func:`~jfleet.testing.train_one_device`)
    and the other under the layout, one step per batch, and compares.

    Args:
      model_fn: builds the plain model, e.g. ``lambda: MyModel(rngs=nnx.Rngs(0))``.
      optimizer: the Optax transform both runs use.
      batches: whole global batches (NumPy or JAX pytrees); read once.
      loss_fn: ``loss_fn(model, batch) -> scalar``; ``to_distributed`` layouts also trace
        it to read the model (so dict batches such as ``{"image": ..., "label": ...}``
        need nothing more), unless the config gives ``forward`` or ``loss_fn``.
      layout: degrees of a forced mesh (``{"dp": 2, "mp": 4}``: ``to_distributed`` with
        ``force_mesh``), a :class:`~jfleet.auto_parallel.ToDistributedConfig`, a
        :class:`~jfleet.strategy.DistributedStrategy` (``fleet.init``, then the model is
        built and wrapped by ``fleet.distributed_model``; its AMP and meta-optimizers
        apply to the reference too), or your own
        ``trainer(model, optimizer, batches, loss_fn) -> losses`` that trains ``model``
        in place. Parameters are compared under the plain model's per-layer paths
        (pipelined or scanned stacks are split back, as checkpoints store them).
      steps: train on the first ``steps`` batches (default: all).
      rtol, atol: the tolerance for losses and parameters: a value passes when
        ``|got - want| <= atol * max(1, max |leaf|) + rtol * |want|``, the absolute part
        scaled by the magnitude of its leaf (for a loss: of that loss). Default for both:
        :func:`default_tolerance` of the layout's devices, ``1e-5 (1 + log2 d)`` (fp32 in
        another reduction order: 4e-5 on 8 devices); pass larger values for half precision.

    Raises:
      AssertionError: a loss or a parameter differs; the message names the first
        diverging step and every differing parameter path.
      ValueError: ``model_fn`` built two different models, or there are no batches.
      NotEnoughDevicesError: the layout needs more devices than this process has.

    The fleet stays initialised with the layout's mesh afterwards.

    Example:
      >>> import optax
      >>> from jfleet.models import TinyLM, lm_batches, lm_loss
      >>> assert_trains_like_one_device(
      ...     TinyLM, optax.sgd(0.1), lm_batches(1), loss_fn=lm_loss, layout={"dp": 8})
    """
    data = list(itertools.islice(batches, steps) if steps is not None else batches)
    if not data:
        raise ValueError(f"batches={batches!r} (steps={steps}): expected at least one batch.")
    needed = _devices_needed(layout)
    if needed is not None:
        require_devices(needed, _describe(layout))
    default = default_tolerance(needed or jax.device_count())
    rtol = default if rtol is None else rtol
    atol = default if atol is None else atol
    got_l, want_l, got, want = _both_runs(model_fn, optimizer, data, loss_fn, layout)
    scale = np.maximum(1.0, np.abs(want_l))
    bad = ~np.isclose(got_l, want_l, rtol=rtol, atol=atol * scale) | ~np.isfinite(got_l)
    leaves = _leaf_report(got, want, rtol, atol)
    if not bad.any() and not leaves:
        return
    tolerance = f"rtol={rtol:.3g}, atol={atol:.3g} x max(1, |leaf|)"
    lines = [f"{_describe(layout)} does not train like one device ({tolerance}):"]
    if bad.any():
        i = int(np.argmax(bad))
        lines.append(
            f"  losses diverge first at step {i}: got {got_l[i]:.7g}, want {want_l[i]:.7g} "
            f"(|diff| {abs(got_l[i] - want_l[i]):.3g})"
        )
        if i > 0:  # which parameters the first i updates already got wrong: run them again
            *_, got_i, want_i = _both_runs(model_fn, optimizer, data[:i], loss_fn, layout)
            early = _leaf_report(got_i, want_i, rtol, atol)
            if early:
                lines.append(f"  after the first {i} update(s) the parameters differ at:")
                lines += _listed(early)
    else:
        lines.append(f"  losses agree over {len(data)} steps")
    shown = min(len(data), 8)
    lines.append(f"  losses (got): {np.array2string(got_l[:shown], precision=6)}")
    lines.append(f"  losses (want): {np.array2string(want_l[:shown], precision=6)}")
    if leaves:
        lines.append(f"  after all {len(data)} steps {len(leaves)} parameter(s) differ:")
        lines += _listed(leaves)
    else:
        lines.append("  final parameters agree")
    raise AssertionError("\n".join(lines))


def _listed(lines: list[str], most: int = 12) -> list[str]:
    more = [f"    ... and {len(lines) - most} more"] if len(lines) > most else []
    return [f"    {line}" for line in lines[:most]] + more


def _both_runs(
    model_fn: Callable[[], nnx.Module],
    optimizer: optax.GradientTransformation,
    data: list,
    loss_fn: Callable,
    layout: Layout,
) -> tuple[np.ndarray, np.ndarray, dict[str, Any], dict[str, Any]]:
    """``(got losses, want losses, got leaves, want leaves)`` of both runs on ``data``."""
    strategy = layout if isinstance(layout, DistributedStrategy) else None
    if isinstance(layout, ToDistributedConfig):
        strategy = layout.strategy
    reference = model_fn()
    before = _params(reference)
    want_losses, _ = train_one_device(reference, optimizer, data, loss_fn, strategy=strategy)
    want = _params(reference)
    got_losses, got, initial = _train_distributed(model_fn, optimizer, data, loss_fn, layout)
    if _leaf_report(initial, before, 0.0, 0.0):
        raise ValueError(
            "model_fn() built two models with different parameters: build it from a fixed "
            "seed (e.g. nnx.Rngs(0)) so both runs start alike."
        )
    got_l, want_l = np.asarray(got_losses, np.float64), np.asarray(want_losses, np.float64)
    return got_l, want_l, got, want


# ----------------------------------------------------------------------- placement


def _flat_arrays(tree: Any) -> dict[str, Any]:
    """``{dotted path: array}`` of an NNX object / State (variable values) or any pytree."""
    if isinstance(tree, (nnx.State, nnx.Pytree)):
        state = tree if isinstance(tree, nnx.State) else nnx.state(tree)
        items = [(".".join(map(str, p)), v.get_value()) for p, v in nnx.to_flat_state(state)]
    else:
        flat, _ = jax.tree_util.tree_flatten_with_path(tree)
        items = [(".".join(_key_name(k) for k in path), x) for path, x in flat]
    return {path: x for path, x in items if hasattr(x, "shape") and hasattr(x, "dtype")}


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def assert_sharded_as(tree: Any, specs: Mapping[str, P | Sequence[Any] | None]) -> None:
    """Every array whose path matches a pattern is laid out as that ``PartitionSpec``.

    Args:
      tree: a model, optimizer or other NNX object, an ``nnx.State``, or any pytree of
        ``jax.Array`` s. Paths are dotted, as the running object holds them
        (``layers.0.mlp.up_proj.kernel``; a pipelined stack is ``layers.body...``).
      specs: ``{pattern: spec}``; patterns are ``fnmatch`` globs (``*`` also matches
        dots), specs a ``PartitionSpec``, a tuple of its entries or None (replicated).
        Every pattern matching an array is checked; shardings are compared by
        equivalence (``P("mp")`` equals ``P("mp", None)`` on a matrix).

    Raises:
      AssertionError: an array is laid out otherwise, or a pattern matches no array;
        every problem is listed.
      TypeError: a spec of another kind.

    Example:
      >>> import jax, numpy as np
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("mp",))
      >>> w = jax.device_put(np.zeros((4, 2)), NamedSharding(mesh, P(None, "mp")))
      >>> assert_sharded_as({"w": w}, {"w": (None, "mp")})
    """
    arrays = _flat_arrays(tree)
    problems = []
    for pattern, spec in specs.items():
        if spec is None:
            spec = P()
        elif isinstance(spec, (tuple, list)) and not isinstance(spec, P):
            spec = P(*spec)
        if not isinstance(spec, P):
            raise TypeError(f"spec {spec!r} for {pattern!r}: expected a PartitionSpec or tuple.")
        matched = [p for p in arrays if fnmatch.fnmatchcase(p, pattern)]
        if not matched:
            known = ", ".join(list(arrays)[:12]) + (" ..." if len(arrays) > 12 else "")
            problems.append(f"{pattern!r} matches no array (paths: {known})")
        for path in matched:
            x = arrays[path]
            sharding = x.sharding if isinstance(x, jax.Array) else None
            if not isinstance(sharding, NamedSharding):
                where = type(sharding).__name__ if sharding is not None else type(x).__name__
                problems.append(f"'{path}': {where}, not on a mesh; want {spec}")
                continue
            if not sharding.is_equivalent_to(NamedSharding(sharding.mesh, spec), x.ndim):
                problems.append(f"'{path}': {sharding.spec}, want {spec}")
    if problems:
        raise AssertionError("placement differs:\n  " + "\n  ".join(problems))


# ------------------------------------------------------------------ compiled programs


def _compiled(step: Any, args: tuple, kwargs: dict, what: str) -> Any:
    """A compiled program from a ``Compiled``, a ``Lowered`` or anything with ``.lower``."""
    if hasattr(step, "as_text") and hasattr(step, "memory_analysis"):
        return step
    if hasattr(step, "compile") and not hasattr(step, "lower"):
        return step.compile()
    if hasattr(step, "lower"):
        return step.lower(*args, **kwargs).compile()
    raise TypeError(
        f"{what}: got {step!r}; expected a jitted function or a jfleet step (with "
        "``.lower``, given its arguments), a jax.stages.Lowered or a jax.stages.Compiled."
    )


def assert_collectives(
    step: Any,
    *args: Any,
    expected: Mapping[str, int],
    expected_bytes: Mapping[str, int] | None = None,
    **kwargs: Any,
) -> dict[str, hlo.KindSummary]:
    """The compiled step runs the ``expected`` number of collectives of each kind listed.

    Counts are per execution of the program, loop bodies weighted by their trip counts
    (:func:`jfleet.testing.hlo.summarize`); kinds not listed are not checked. XLA combines
    the backward pass's collectives, so exact counts are most telling on forward programs;
    ``expected_bytes`` (the full buffers moved, weighted the same way) pins a step's.

    Args:
      step: a jitted function or a jfleet step (``make_train_step``) with its ``*args``
        / ``**kwargs``, a ``jax.stages.Lowered``, a ``jax.stages.Compiled`` or HLO text.
      expected: ``{kind: count}``, kinds among ``all-reduce``, ``reduce-scatter``,
        ``all-gather``, ``collective-permute``, ``all-to-all`` (and XLA's rarer ones).
      expected_bytes: ``{kind: bytes}`` to check as well.

    Returns:
      The per-kind summary of the program.

    Raises:
      AssertionError: a count or byte total differs; the message lists the program's
        collectives.
      ValueError: an unknown kind.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> summary = assert_collectives(jax.jit(jnp.sin), jnp.ones(4), expected={"all-reduce": 0})
    """
    unknown = sorted((set(expected) | set(expected_bytes or {})) - set(hlo._ALL_KINDS))
    if unknown:
        raise ValueError(f"collective kinds {unknown}: expected among {list(hlo._ALL_KINDS)}.")
    if isinstance(step, str):
        text = step
    else:
        text = _compiled(step, args, kwargs, "assert_collectives").as_text()
    items = hlo.collectives(text)
    summary = hlo.summarize(items)
    none = hlo.KindSummary(count=0, bytes=0, wire_bytes=0.0, sliced_bytes=0)
    wrong = [
        f"{kind}: {summary.get(kind, none).count}, want {n}"
        for kind, n in expected.items()
        if summary.get(kind, none).count != n
    ]
    wrong += [
        f"{kind}: {summary.get(kind, none).bytes} bytes, want {n}"
        for kind, n in (expected_bytes or {}).items()
        if summary.get(kind, none).bytes != n
    ]
    if wrong:
        listed = [
            f"  {c.kind}: {c.bytes} bytes x{c.weight}, groups of {c.group_size}" for c in items
        ]
        raise AssertionError(
            "collectives differ: "
            + "; ".join(wrong)
            + "\nthe program's collectives:\n"
            + ("\n".join(listed) or "  none")
        )
    return summary


def assert_peak_memory_below(step: Any, limit: int, *args: Any, **kwargs: Any) -> int:
    """The compiled step needs fewer than ``limit`` bytes per device; returns what it needs.

    The need is ``memory_analysis()``'s arguments + outputs + temporaries - aliased bytes
    (or its ``peak_memory_in_bytes`` when larger: on XLA:CPU that figure leaves the
    temporaries out).

    Args:
      step: as for :func:`assert_collectives` (not HLO text), with its arguments.
      limit: bytes per device.

    Raises:
      AssertionError: it needs ``limit`` or more; the message has the breakdown.
      ValueError: ``limit`` is not a positive number.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> assert_peak_memory_below(jax.jit(jnp.sin), 1 << 20, jnp.ones(4)) < 1 << 20
      True
    """
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0:
        raise ValueError(f"limit={limit!r}: expected a positive number of bytes.")
    stats = _compiled(step, args, kwargs, "assert_peak_memory_below").memory_analysis()
    parts = {
        "arguments": stats.argument_size_in_bytes,
        "outputs": stats.output_size_in_bytes,
        "temporaries": stats.temp_size_in_bytes,
        "aliased": -stats.alias_size_in_bytes,
    }
    need = max(sum(parts.values()), int(getattr(stats, "peak_memory_in_bytes", 0) or 0))
    if need >= limit:
        shown = ", ".join(f"{k} {abs(v):,}" for k, v in parts.items())
        raise AssertionError(
            f"the compiled step needs {need:,} bytes per device ({shown}), "
            f"not below the limit {int(limit):,}"
        )
    return need
