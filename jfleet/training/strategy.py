"""``DistributedStrategy``: every switch and ``*_configs`` section of Paddle Fleet's strategy.

Names and defaults are those of Paddle 3.3's ``distributed_strategy.proto``, plus the two
settings Paddle keeps outside the proto (``hybrid_configs['order']``, alias
``hybrid_parallel_order``, and ``hybrid_configs['mp_configs']['sync_param_name']``) and two
jfleet keys: ``amp_configs['dtype']`` (the O1 compute dtype, ``"float16"`` or
``"bfloat16"``; O2 comes from ``use_pure_fp16`` / ``use_pure_bf16`` as in Paddle) and
``nonfinite`` (what a training step with an inf / nan loss or gradient does: ``"warn"``,
the default, logs it once and applies the update; ``"skip"`` drops the update, leaving
parameters and optimizer state bit-identical; ``"raise"`` drops it and raises
:class:`~jfleet.nonfinite.NonFiniteError` naming the step and the first non-finite leaf;
see :mod:`jfleet.nonfinite`). The
schema, value ranges and SPMD no-op table are in :mod:`jfleet.training.strategy_schema`.

Semantics, and where they differ from Paddle on purpose:

- ``strategy.amp = True`` sets a switch; a wrong type is a ``TypeError``.
- ``strategy.amp_configs = {...}`` MERGES into the current values, nested sections too
  (``hybrid_configs={'mp_configs': {...}}``). A list value replaces the old list (Paddle
  appends to it, so assigning a section twice duplicated entries).
- Getting a section returns a :class:`ConfigDict`: a snapshot of its values whose keys
  also read as attributes, and whose writes -- item or attribute, on the section or on
  a nested one -- are validated and written through to the strategy, as Paddle's
  protobuf sections are: ``strategy.hybrid_configs["pp_configs"].delay_scale_loss =
  True`` or ``strategy.amp_configs["init_loss_scaling"] = 1024.0``. (Paddle writes
  through nested sections only; a write to its top-level dict is silently lost.) Lists
  read from a strategy are :class:`ConfigList`: their mutations write through, as
  Paddle's repeated fields and list attributes do.
- An unknown setting is a :class:`StrategyKeyError` (``TypeError`` as in Paddle, and
  ``AttributeError``); an unknown key inside a section is a :class:`ConfigKeyError`
  (``KeyError`` and ``ValueError``), on an attribute a :class:`ConfigAttributeError`
  (also an ``AttributeError``, as protobuf raises). Each lists the valid keys and, when
  the key belongs to another section, says which.
- Values are checked as Paddle's protobuf checks them, plus Paddle's ranges: ints where
  ints are expected (numpy ints are fine, floats are not), floats finite (an int is
  fine), bools ``True`` / ``False`` (inside a section ``0`` and ``1`` too, read as bools
  as protobuf reads them); every numeric field has a range (``last_comm_group_size_MB >
  0`` as Paddle's setter, degrees ``>= 1``, ``dp_degree`` also ``-1``: "the rest").
  Every error names the field, the value and what is expected, and its suggested fix
  is accepted.
- ``hybrid_configs['order']`` accepts Paddle's four-axis orders (without ``sep``, as
  written for Paddles without the sep axis), five-axis orders and six-axis ones (with
  ``cp``); it is stored completed to jfleet's five mesh axes, see
  :func:`~jfleet.training.strategy_schema.complete_order`. Paddle's own check of the order
  never fires; jfleet's names the problem and suggests an order.
- ``hybrid_configs['order']`` survives ``save_to_prototxt`` / ``load_from_prototxt``
  (Paddle loses it).
- Paddle's ``a_sync`` setter also resets ``a_sync_configs['k_steps']`` to 0; jfleet keeps
  parameter-server settings as plain data and does not.
- Settings that mean nothing under SPMD are accepted and logged by ``fleet.init``
  (:data:`SPMD_NOOP_SETTINGS` has each one with the reason).
"""

from __future__ import annotations

import copy
import difflib
import math
import numbers
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from jfleet.training import prototxt as _prototxt
from jfleet.training.strategy_schema import (
    ALIASES,
    NORMALIZE,
    NOT_MODELLED,
    RULES,
    SCHEMA,
    SPMD_NOOP_SETTINGS,
    ListOf,
    rule_path,
)

__all__ = [
    "SPMD_NOOP_SETTINGS",
    "ConfigAttributeError",
    "ConfigDict",
    "ConfigKeyError",
    "ConfigList",
    "DistributedStrategy",
    "StrategyKeyError",
]


class StrategyKeyError(TypeError, AttributeError):
    """An unknown ``DistributedStrategy`` setting (Paddle raises ``TypeError``)."""


class ConfigKeyError(KeyError, ValueError):
    """An unknown key inside a ``*_configs`` section."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ConfigAttributeError(ConfigKeyError, AttributeError):
    """An unknown attribute of a section (protobuf raises ``AttributeError``)."""


def _defaults(spec: Any) -> Any:
    if isinstance(spec, dict):
        return {key: _defaults(sub) for key, sub in spec.items()}
    if isinstance(spec, ListOf):
        return list(spec.default)
    return spec


def _suggest(name: object, valid: Any) -> str:
    close = difflib.get_close_matches(str(name), list(valid), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _code(path: Iterable[str], value: Any) -> str:
    """The Paddle-style statement that sets dotted ``path`` to ``value`` on ``strategy``."""
    top, *rest = path
    if not rest:
        return f"strategy.{top} = {value!r}"
    where = "".join(f"[{key!r}]" for key in rest[:-1])
    return f"strategy.{top}{where}.{rest[-1]} = {value!r}"


def _sections_with(key: str, schema: dict = SCHEMA, path: tuple = ()) -> list[tuple[str, ...]]:
    out = []
    for name, spec in schema.items():
        if isinstance(spec, dict):
            if key in spec and not isinstance(spec[key], dict):
                out.append((*path, name))
            out.extend(_sections_with(key, spec, (*path, name)))
    return out


def _unknown_key(key: object, path: str, valid: Iterable[str], value: Any) -> str:
    """The message for ``key`` set in the section at dotted ``path``; says where it lives."""
    valid = list(valid)
    elsewhere = [s for s in _sections_with(str(key)) if ".".join(s) != path]
    hint = ""
    if elsewhere:
        where = ", ".join(".".join(s) for s in elsewhere)
        hint = f" It is a key of {where}: {_code((*elsewhere[0], key), value)}."
    return (
        f"{key!r} is not a key of {path}.{hint or _suggest(key, valid)} "
        f"Valid keys: {', '.join(valid)}."
    )


def _expected(spec: Any, in_section: bool) -> str:
    if isinstance(spec, bool):
        return "a bool (True or False" + (", or 0 / 1)" if in_section else ")")
    return {int: "an int", float: "a finite float (an int is fine)", str: "a str"}[type(spec)]


def _coerce(path: str, spec: Any, value: Any) -> Any:
    """Type-checks ``value`` against the default ``spec``, value-checks it, normalises it."""
    got = f"got {value!r} of type {type(value).__name__}"
    in_section = "." in path
    if isinstance(spec, ListOf):
        if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
            raise TypeError(f"{path} expects a list of {spec.describe()}, {got}.")
        if isinstance(spec.item, dict):
            out = [_merged(spec.item, {}, v, f"{path}[{i}]") for i, v in enumerate(value)]
        else:
            out = [_coerce(f"{path}[{i}]", spec.item(), v) for i, v in enumerate(value)]
    elif isinstance(spec, bool):
        # Inside a section, 0 and 1 are bools, as protobuf reads them (split_param = 0).
        as_int = in_section and isinstance(value, numbers.Integral) and value in (0, 1)
        if not (isinstance(value, bool) or as_int):
            raise TypeError(f"{path} expects {_expected(spec, in_section)}, {got}.")
        out = bool(value)
    elif isinstance(spec, int):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{path} expects {_expected(spec, in_section)}, {got}.")
        out = int(value)
    elif isinstance(spec, float):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{path} expects {_expected(spec, in_section)}, {got}.")
        out = float(value)
        if not math.isfinite(out):
            raise ValueError(f"{path}={value!r} is not finite; set it to a number, e.g. {spec!r}.")
    else:
        if not isinstance(value, str):
            raise TypeError(f"{path} expects {_expected(spec, in_section)}, {got}.")
        out = value
    key = rule_path(path)
    rule = RULES.get(key)
    if rule is not None and not rule[0](out):
        expected = rule[1](out) if callable(rule[1]) else rule[1]
        raise ValueError(f"{path}={value!r} is not valid; set it to {expected}.")
    return NORMALIZE.get(key, lambda v: v)(out)


def _merged(schema: dict, current: dict, update: Any, path: str) -> dict:
    """A copy of ``current`` (defaults filled in) with ``update`` merged in, all checked."""
    if not isinstance(update, Mapping):
        key = next(iter(schema))
        raise TypeError(
            f"{path or 'DistributedStrategy.from_dict'} expects a dict, got {update!r} of type "
            f"{type(update).__name__}; e.g. {{{key!r}: {_defaults(schema[key])!r}}}."
        )
    out = {key: copy.deepcopy(current[key]) if key in current else _defaults(spec)
           for key, spec in schema.items()}  # fmt: skip
    for key, value in update.items():
        if key not in schema:
            if not path:
                raise StrategyKeyError(_unknown_setting(key))
            raise ConfigKeyError(_unknown_key(key, path, schema, value))
        spec, sub = schema[key], _join(path, key)
        if isinstance(spec, dict):
            out[key] = _merged(spec, out[key], value, sub)
        else:
            out[key] = _coerce(sub, spec, value)
    return out


def _unknown_setting(name: object) -> str:
    if name in NOT_MODELLED:
        return f"{name!r} is a Paddle setting that jfleet does not model (static graph / PS)."
    valid = [*SCHEMA, *(alias for alias in ALIASES if not alias.startswith("_"))]
    return (
        f"{name!r} is not a DistributedStrategy setting.{_suggest(name, valid)} "
        f"Valid settings: {', '.join(valid)}."
    )


def _diff(values: dict, defaults: dict) -> dict:
    out = {}
    for key, default in defaults.items():
        value = values[key]
        if value != default:
            out[key] = _diff(value, default) if isinstance(default, dict) else value
    return out


class ConfigDict(dict):
    """A ``*_configs`` section read from a strategy: its values, writable as Paddle's are.

    Keys read as items or attributes. A write -- ``section[key] = v``, ``section.key =
    v``, ``update``, ``setdefault`` or ``|=`` -- is validated and written through to the
    strategy, and this snapshot follows; nested sections are ``ConfigDict`` too. Keys
    are fixed (they are proto fields): unknown ones raise :class:`ConfigKeyError` (items)
    or :class:`ConfigAttributeError` (attributes), and keys cannot be deleted. Sections
    inside a list (``recompute_configs['refined_ops_patterns'][0]``) write through too,
    and lists are :class:`ConfigList`. Copies and pickles are plain dicts.

    Example:
      >>> strategy = DistributedStrategy()
      >>> strategy.hybrid_configs["sharding_configs"].tensor_fusion = True
      >>> strategy.hybrid_configs["sharding_configs"]["tensor_fusion"]
      True
      >>> strategy.amp_configs["init_loss_scaling"] = 1024.0
      >>> strategy.amp_configs.init_loss_scaling
      1024.0
    """

    __slots__ = ("_owner", "_path")

    def __init__(self, values: Mapping[str, Any], owner: DistributedStrategy, path: tuple) -> None:
        dict.__init__(self, values)
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_path", path)

    def _where(self) -> str:
        return ".".join(str(key) for key in self._path) or "this section"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError:
            raise ConfigAttributeError(
                f"{name!r} is not a key of {self._where()}.{_suggest(name, self)} "
                f"Valid keys: {', '.join(self)}."
            ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self._write({name: value}, ConfigAttributeError)

    def __setitem__(self, key: str, value: Any) -> None:
        self._write({key: value}, ConfigKeyError)

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self._write(dict(*args, **kwargs), ConfigKeyError)

    def __ior__(self, other: Any) -> ConfigDict:  # type: ignore[override]
        self.update(other)
        return self

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self._write({key: default}, ConfigKeyError)  # raises: keys are fixed
        return self[key]

    def _write(self, update: dict[str, Any], error: type[ConfigKeyError]) -> None:
        for key, value in update.items():
            if key not in self:
                raise error(_unknown_key(key, self._where(), self, value))
        owner, path = self._owner, self._path
        stored = owner._assign(path, update)
        for key in update:
            dict.__setitem__(self, key, _view(stored[key], owner, (*path, key)))

    def __delitem__(self, key: str) -> None:
        default = _default_at(self._path, key)
        raise TypeError(
            f"the keys of {self._where()} are fixed (Paddle's proto fields) and cannot be "
            f"deleted; to reset {key!r}, set it to its default: section[{key!r}] = {default!r}."
        )

    def _fixed_keys(self, *_: Any) -> Any:
        key = next(iter(self))
        raise TypeError(
            f"the keys of {self._where()} are fixed (Paddle's proto fields) and cannot be "
            f"removed; set a key instead, e.g. section[{key!r}] = {_default_at(self._path, key)!r}."
        )

    pop = popitem = clear = _fixed_keys  # type: ignore[assignment]

    def __copy__(self) -> dict:
        return dict(self)

    def __deepcopy__(self, memo: dict) -> dict:
        return copy.deepcopy(dict(self), memo)

    def __reduce__(self) -> tuple:
        return dict, (dict(self),)


class ConfigList(list):
    """A list setting read from a strategy: its mutations are checked and written through.

    Paddle's repeated proto fields and its list attributes (``hybrid_parallel_order``,
    ``sync_param_name``) are live, so ``strategy.recompute_configs["checkpoints"]
    .append("blocks.0")`` changes the strategy; here too. Every mutating list method is
    checked as an assignment of the whole new list, and a bad one changes nothing.
    Copies and pickles are plain lists.

    Example:
      >>> strategy = DistributedStrategy()
      >>> strategy.amp_configs["custom_white_list"].append("matmul")
      >>> strategy.amp_configs["custom_white_list"]
      ['matmul']
    """

    __slots__ = ("_owner", "_path")

    def __init__(self, items: Iterable[Any], owner: DistributedStrategy, path: tuple) -> None:
        list.__init__(self, items)
        self._owner = owner
        self._path = path

    def _store(self, new: list) -> None:
        *parent, key = self._path
        stored = self._owner._assign(tuple(parent), {key: new})[key]
        list.__init__(self, _view(stored, self._owner, self._path))

    def __copy__(self) -> list:
        return list(self)

    def __deepcopy__(self, memo: dict) -> list:
        return copy.deepcopy(list(self), memo)

    def __reduce__(self) -> tuple:
        return list, (list(self),)


def _write_through(name: str) -> Callable[..., Any]:
    method = getattr(list, name)

    def mutate(self: ConfigList, *args: Any) -> Any:
        new = list(self)
        result = method(new, *args)
        self._store(new)
        return self if name in ("__iadd__", "__imul__") else result

    mutate.__name__ = mutate.__qualname__ = name
    mutate.__doc__ = method.__doc__
    return mutate


for _name in (
    "append", "extend", "insert", "remove", "pop", "clear", "sort", "reverse",
    "__setitem__", "__delitem__", "__iadd__", "__imul__",
):  # fmt: skip
    setattr(ConfigList, _name, _write_through(_name))


def _view(value: Any, owner: DistributedStrategy, path: tuple) -> Any:
    if isinstance(value, dict):
        items = {key: _view(sub, owner, (*path, key)) for key, sub in value.items()}
        return ConfigDict(items, owner, path)
    if isinstance(value, list):
        items = [_view(item, owner, (*path, i)) for i, item in enumerate(value)]
        return ConfigList(items, owner, path)
    return value


def _default_at(path: tuple, key: str) -> Any:
    """Paddle's default of ``key`` in the section at ``path`` (list indices skipped)."""
    spec: Any = SCHEMA
    for part in path:
        spec = spec.item if isinstance(spec, ListOf) else spec[part]
    return _defaults(spec[key])


def _merged_at(value: dict, path: tuple, update: dict[str, Any]) -> dict:
    """A copy of nested dict ``value`` with ``update`` set at ``path`` inside it (unchecked)."""
    out = copy.deepcopy(value)
    node = out
    for key in path:
        node = node[key]
    node.update(update)
    return out


def _from_entries(schema: dict, entries: list[_prototxt.Entry], path: str) -> dict:
    """Types and checks parsed text-format entries against ``schema``; errors name the line."""
    out: dict[str, Any] = {}
    first_line: dict[str, int] = {}
    for entry in entries:
        sub, spec = _join(path, entry.name), schema.get(entry.name)
        where = f"line {entry.line}: "
        if entry.name not in schema:
            where_key = f"in {path}" if path else "at the top level"
            raise ValueError(
                f"{where}unknown field {entry.name!r} {where_key}.{_suggest(entry.name, schema)} "
                f"Valid fields: {', '.join(schema)}."
            )
        is_list = isinstance(spec, ListOf)
        if entry.name in first_line and not is_list:
            raise ValueError(
                f"{where}{sub} is set twice (first on line {first_line[entry.name]}); keep one."
            )
        first_line.setdefault(entry.name, entry.line)
        if isinstance(spec, dict) or (is_list and isinstance(spec.item, dict)):
            ok, form = entry.kind != "scalar", f"{entry.name} {{ ... }}"
        elif is_list:
            ok, form = entry.kind != "block", f"{entry.name}: [value, ...]"
        else:
            ok, form = entry.kind == "scalar", f"{entry.name}: value"
        if not ok or (isinstance(spec, dict) and entry.kind == "list"):
            raise ValueError(f"{where}{sub} has the wrong form; write it as `{form}`.")
        try:
            if isinstance(spec, dict):
                out[entry.name] = _from_entries(spec, entry.value, sub)
            elif is_list and entry.kind == "block":
                out.setdefault(entry.name, []).append(_from_entries(spec.item, entry.value, sub))
            elif is_list and isinstance(spec.item, dict):
                if entry.value:
                    raise ValueError(f"{sub} takes blocks `{entry.name} {{ ... }}`, not values.")
                out.setdefault(entry.name, [])
            elif is_list:
                items = entry.value if entry.kind == "list" else [entry.value]
                out.setdefault(entry.name, []).extend(_scalar(spec.item(), s) for s in items)
            else:
                out[entry.name] = _coerce(sub, spec, _scalar(spec, entry.value))
        except (TypeError, ValueError) as err:  # a nested error already names its line
            msg = str(err)
            raise ValueError(msg if msg.startswith("line ") else where + msg) from None
    for name, value in out.items():  # lists are checked whole, once all lines are read
        spec = schema[name]
        if isinstance(spec, ListOf) and not isinstance(spec.item, dict):
            try:
                out[name] = _coerce(_join(path, name), spec, value)
            except ValueError as err:
                raise ValueError(f"line {first_line[name]}: {err}") from None
    return out


def _scalar(spec: Any, scalar: _prototxt.Scalar) -> Any:
    if isinstance(spec, bool):
        return _prototxt.to_bool(scalar)
    if isinstance(spec, int):
        return _prototxt.to_int(scalar)
    if isinstance(spec, float):
        return _prototxt.to_float(scalar)
    return _prototxt.to_str(scalar)


class DistributedStrategy:
    """Paddle Fleet's ``DistributedStrategy``: switches and ``*_configs`` sections.

    Every setting of Paddle 3.3 with Paddle's name and default. Switches are plain
    attributes; assigning a ``*_configs`` dict merges it into the current values (nested
    sections too); getting one returns a :class:`ConfigDict` whose item and attribute
    writes (nested sections too) are checked and written through, as Paddle's protobuf
    sections are. In SPMD only some settings act (the
    hybrid degrees and ``order``, AMP, gradient merge, recompute, sharding stage, pipeline
    micro-batching, LAMB/LARS...); :meth:`spmd_noop_settings` lists those set to no effect,
    and parameter-server settings (``a_sync`` ...) are kept as data only.

    ``nonfinite`` (a jfleet setting: ``"warn"``, ``"skip"`` or ``"raise"``) is what the
    training step does with an inf / nan loss or gradient (:mod:`jfleet.nonfinite`).

    The ZeRO stage is ``sharding_configs['stage']`` (1, 2 or 3), as in Paddle.
    ``sharding_configs['_dp_as_optimizer_sharding'] = True`` (Paddle's static-graph switch
    for sharding the optimizer over the data-parallel ranks) makes ZeRO span every rank
    holding the same parameters, ``dp x sharding x sep``: with AMP O2 that is
    Megatron's distributed optimizer (half-precision parameters, fp32 masters and
    moments split over all data-parallel and sequence-parallel ranks); without a
    sharding axis it needs ``strategy.sharding = True``. The mesh
    axis order is ``hybrid_configs['order']`` (alias ``hybrid_parallel_order``); four-,
    five- and six-axis Paddle orders are accepted and stored as five
    (:func:`~jfleet.training.strategy_schema.complete_order`).

    Raises:
      StrategyKeyError: an unknown setting, on get or set (a ``TypeError`` and an
        ``AttributeError``).
      ConfigKeyError: an unknown key in a section (a ``KeyError`` and a ``ValueError``;
        :class:`ConfigAttributeError`, also an ``AttributeError``, for attribute access).
      TypeError: a value of the wrong type (bool for switches, the default's type for
        config values; an int is fine where a float is expected, a bool never is a number).
      ValueError: a value out of range, e.g. ``sharding_configs={'stage': 4}``.

    Example:
      >>> strategy = DistributedStrategy()
      >>> strategy.amp = True
      >>> strategy.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
      >>> strategy.hybrid_configs["mp_degree"]
      4
      >>> strategy
      DistributedStrategy(amp=True, hybrid_configs={'dp_degree': 2, 'mp_degree': 4})
    """

    __slots__ = ("_values",)

    def __init__(self) -> None:
        object.__setattr__(self, "_values", _defaults(SCHEMA))

    # ------------------------------------------------------------------ attributes
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_values":
            raise AttributeError(name)
        path = ALIASES.get(name, (name,))
        if path[0] not in SCHEMA:
            raise StrategyKeyError(_unknown_setting(name))
        return _view(self._get(path), self, path)

    def __setattr__(self, name: str, value: Any) -> None:
        path = ALIASES.get(name, (name,))
        if path[0] not in SCHEMA:
            raise StrategyKeyError(_unknown_setting(name))
        for key in reversed(path[1:]):
            value = {key: value}
        top = path[0]
        self._values[top] = _merged(SCHEMA, self._values, {top: value}, "")[top]

    def _get(self, path: tuple) -> Any:
        """A deep copy of the value at ``path`` (keys and list indices)."""
        value = self._values
        for key in path:
            value = value[key]
        return copy.deepcopy(value)

    def _assign(self, path: tuple, update: Mapping[str, Any]) -> dict[str, Any]:
        """Merges ``update`` into the section at ``path`` (checked, all or nothing).

        ``path`` may pass through a list of sections (an int index): the whole list is
        assigned again with that item changed.

        Returns:
          A copy of the section as stored (values normalised).
        """
        at = next((i for i, key in enumerate(path) if isinstance(key, int)), None)
        if at is not None:
            items = self._get(path[:at])
            items[path[at]] = _merged_at(items[path[at]], path[at + 1 :], update)
            self._assign(path[: at - 1], {path[at - 1]: items})
            return self._get(path)
        nested: Any = dict(update)
        for key in reversed(path[1:]):
            nested = {key: nested}
        top = path[0]
        self._values[top] = _merged(SCHEMA, self._values, {top: nested}, "")[top]
        return self._get(path)

    def __delattr__(self, name: str) -> None:
        raise TypeError(f"DistributedStrategy settings cannot be deleted ({name!r}); assign one.")

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *SCHEMA, *ALIASES})

    # ------------------------------------------------------------------ value semantics
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DistributedStrategy):
            return NotImplemented
        return self._values == other._values

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        diff = _diff(self._values, _defaults(SCHEMA))
        return f"DistributedStrategy({', '.join(f'{k}={v!r}' for k, v in diff.items())})"

    def __copy__(self) -> DistributedStrategy:
        return self.from_dict(self._values)

    def __deepcopy__(self, memo: dict) -> DistributedStrategy:
        return self.from_dict(self._values)

    def __getstate__(self) -> dict[str, Any]:
        return self.to_dict()

    def __setstate__(self, state: dict[str, Any]) -> None:
        object.__setattr__(self, "_values", _merged(SCHEMA, _defaults(SCHEMA), state, ""))

    def to_dict(self) -> dict[str, Any]:
        """A deep copy of every setting, as plain nested dicts and lists."""
        return copy.deepcopy(self._values)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DistributedStrategy:
        """A strategy with ``values`` (any subset of :meth:`to_dict`'s keys) over the defaults.

        Raises:
          StrategyKeyError: an unknown top-level setting.
          ConfigKeyError: an unknown key in a section.
          TypeError: a value of the wrong type.
          ValueError: a value out of range.
        """
        strategy = cls()
        object.__setattr__(strategy, "_values", _merged(SCHEMA, strategy._values, values, ""))
        return strategy

    # ------------------------------------------------------------------ SPMD
    def spmd_noop_settings(self) -> list[str]:
        """The settings set to a non-default value that mean nothing under SPMD.

        Returns:
          Dotted names, keys of :data:`SPMD_NOOP_SETTINGS`, in its order, e.g.
          ``["fuse_grad_size_in_MB", "hybrid_configs.mp_configs.sync_grad"]``.
        """
        defaults = _defaults(SCHEMA)
        out = []
        for name in SPMD_NOOP_SETTINGS:
            value, default = self._values, defaults
            for key in name.split("."):
                value, default = value[key], default[key]
            if value != default:
                out.append(name)
        return out

    # ------------------------------------------------------------------ files
    def save_to_prototxt(self, output: str | os.PathLike, *, only_changed: bool = False) -> None:
        """Writes the settings to ``output`` in protobuf text format (no protobuf needed).

        Unlike Paddle's, the file keeps ``hybrid_configs { order: ... }`` and
        ``sync_param_name``, so :meth:`load_from_prototxt` restores an equal strategy.

        Args:
          output: the file to write.
          only_changed: write only the settings that differ from the defaults (a short
            file; loading it into a fresh strategy still gives an equal one). By default
            every setting is written, so loading it into any strategy restores this one.
        """
        values = _diff(self._values, _defaults(SCHEMA)) if only_changed else self._values
        which = "the settings that differ from the defaults" if only_changed else "every setting"
        header = f"jfleet DistributedStrategy in protobuf text format: {which}."
        Path(output).write_text(_prototxt.dump(values, header), encoding="utf-8")

    def load_from_prototxt(self, pb_file: str | os.PathLike) -> None:
        """Merges the settings in text-format file ``pb_file`` into this strategy.

        Fields the file leaves out keep their current values (Paddle merges too); a file
        from :meth:`save_to_prototxt` sets every field. Nothing changes if the file is bad.

        Raises:
          ValueError: the file is malformed, or holds an unknown field or a bad value;
            the message names the file and the line.
        """
        text = Path(pb_file).read_text(encoding="utf-8")
        try:
            update = _from_entries(SCHEMA, _prototxt.parse(text), "")
        except ValueError as err:
            raise ValueError(f"{os.fspath(pb_file)}: {err}") from None
        object.__setattr__(self, "_values", _merged(SCHEMA, self._values, update, ""))
