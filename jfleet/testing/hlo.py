"""Count the collectives of a compiled XLA program and their bytes, and its dot FLOPs, from HLO.

``collectives(text)`` reads the optimised HLO that ``jax.jit(f).lower(...).compile().as_text()``
prints and returns one :class:`Collective` per collective instruction, with

  * ``weight``: how many times one run of the program executes it — 1 in the entry
    computation, multiplied by ``known_trip_count`` for each enclosing ``while`` body;
  * ``bytes``: the size of the full buffer it moves per execution (the larger of its
    operands and its result: the array for an all-reduce, the input of a reduce-scatter,
    the output of an all-gather);
  * ``group_size``: the number of devices in each replica group, from any of XLA's
    three spellings (explicit ``{{0,1},{2,3}}``, iota ``[2,4]<=[8]``, and
    ``mesh[...] {'axis'}``).

Asynchronous forms are counted once: ``all-reduce-start`` / ``-done`` (and the other
``-start`` / ``-done`` pairs) at the start, with the result size taken from the matching
done; a generic ``async-start`` by the collective inside the computation it wraps
(``async-update`` and ``async-done`` are skipped).

XLA:CPU has no pass that turns an all-reduce followed by a ``dynamic-slice`` of its result
into a reduce-scatter (GPU and TPU run ``ReduceScatterCreator``), so a sharded gradient
reduction appears on CPU as an all-reduce whose result is only sliced. ``sliced_bytes``
reports the part of an all-reduce's result that is used only through ``dynamic-slice``:
the bytes a GPU/TPU build would reduce-scatter instead.

``dot_flops(text)`` counts the floating-point operations of every ``dot`` and
``convolution``, weighted the same way by the trip counts of enclosing loops (which
``compiled.cost_analysis()`` does not do: it counts a loop body once). It counts every branch
of a ``conditional``; ``conditionals(text)`` lists each conditional with its loop weight and
the dot FLOPs of each branch, and ``executed_flops(text, taken)`` weights the branches by
how often a schedule takes them (the FLOPs a device executes when bubbles are skipped).

Example:
  >>> text = '''
  ... HloModule m, num_partitions=4
  ... ENTRY %main (p: f32[8]) -> f32[8] {
  ...   %p = f32[8]{0} parameter(0)
  ...   ROOT %ar = f32[8]{0} all-reduce(%p), replica_groups=[1,4]<=[4], to_apply=%add
  ... }
  ... '''
  >>> [(c.kind, c.bytes, c.group_size) for c in collectives(text)]
  [('all-reduce', 32, 4)]
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

#: The collective kinds reported, in table order.
KINDS = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")
_EXTRA_KINDS = ("ragged-all-to-all", "collective-broadcast")
_ALL_KINDS = KINDS + _EXTRA_KINDS

_DTYPE_BITS = {
    "pred": 8,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "f16": 16,
    "bf16": 16,
    "s32": 32,
    "u32": 32,
    "f32": 32,
    "s64": 64,
    "u64": 64,
    "f64": 64,
    "c64": 64,
    "c128": 128,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_CALLEES = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_PASS_THROUGH = ("bitcast", "copy", "reshape", "transpose")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program.

    Attributes:
      kind: one of :data:`KINDS` (or ``ragged-all-to-all`` / ``collective-broadcast``).
      name: the instruction's name in the HLO text.
      weight: executions per run of the program (product of enclosing trip counts).
      bytes: bytes of the full buffer per execution (see the module docstring).
      group_size: devices per replica group; None when the text does not say
        (a collective-permute, or an empty group list in a module without
        ``num_partitions``).
      sliced_bytes: for an all-reduce, the bytes of its result used only through
        ``dynamic-slice`` (a decomposed reduce-scatter); 0 otherwise.
      trip_count_known: False when an enclosing while loop has no ``known_trip_count``
        (the loop is then counted once).
      groups: the replica groups (device ids per group), or None when the text
        does not say.
    """

    kind: str
    name: str
    weight: int
    bytes: int
    group_size: int | None
    sliced_bytes: int = 0
    trip_count_known: bool = True
    groups: tuple[tuple[int, ...], ...] | None = None

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends per execution with ring algorithms.

        All-reduce ``2 (n-1)/n B``; reduce-scatter, all-gather and all-to-all
        ``(n-1)/n B``; collective-permute and broadcast ``B``.
        """
        n = self.group_size
        if self.kind in ("collective-permute", "collective-broadcast") or not n:
            return float(self.bytes)
        factor = 2.0 if self.kind == "all-reduce" else 1.0
        return factor * (n - 1) / n * self.bytes


@dataclasses.dataclass(frozen=True)
class KindSummary:
    """Totals over one collective kind, weighted by executions per step."""

    count: int
    bytes: int
    wire_bytes: float
    sliced_bytes: int = 0


@dataclasses.dataclass
class _Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    args: str
    attrs: str


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (arrays and tuples of arrays; tokens count 0).

    >>> shape_bytes("(f32[32,64]{1,0}, bf16[8]{0}, s32[])")
    8212
    """
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        bits = _DTYPE_BITS.get(dtype)
        if bits is None and dtype.startswith("f8"):
            bits = 8
        if bits is None:
            continue
        sizes = [int(d.replace("<=", "")) for d in dims.split(",") if d.strip()]
        total += (math.prod(sizes) * bits + 7) // 8
    return total


def _split_shape(rest: str) -> tuple[str, str]:
    """Splits ``'<shape> <opcode>(...)...'`` into the shape and the remainder."""
    rest = rest.lstrip()
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            if ch == "(":
                depth += 1
            elif ch == ")":
                depth -= 1
                if depth == 0:
                    return rest[: i + 1], rest[i + 1 :]
        return rest, ""
    head, _, tail = rest.partition(" ")
    return head, " " + tail


def _split_call(rest: str) -> tuple[str, list[str], str, str] | None:
    """``' opcode(%a, %b), attrs'`` -> (opcode, operand names, argument text, attrs)."""
    match = _OPCODE.match(rest)
    if not match:
        return None
    start = match.end()
    depth = 1
    i = start
    while i < len(rest) and depth:
        if rest[i] == "(":
            depth += 1
        elif rest[i] == ")":
            depth -= 1
        i += 1
    inside = rest[start : i - 1]
    operands = re.findall(r"%([\w.\-]+)", inside)
    return match.group(1), operands, inside, rest[i:]


def _parse(text: str) -> tuple[dict[str, list[_Instruction]], str | None, int | None]:
    """Computations (name -> instructions), the entry's name, and ``num_partitions``."""
    computations: dict[str, list[_Instruction]] = {}
    entry = None
    partitions = None
    current: list[_Instruction] | None = None
    for line in text.splitlines():
        if line.startswith("HloModule"):
            found = re.search(r"num_partitions=(\d+)", line)
            partitions = int(found.group(1)) if found else None
            continue
        stripped = line.strip()
        if current is None:
            header = _HEADER.match(line)
            if header:
                current = computations.setdefault(header.group(2), [])
                if header.group(1):
                    entry = header.group(2)
            continue
        if stripped == "}":
            current = None
            continue
        found = _INSTRUCTION.match(line)
        if not found:
            continue
        shape, rest = _split_shape(found.group(2))
        call = _split_call(rest)
        if call is None:
            continue
        opcode, operands, args, attrs = call
        current.append(_Instruction(found.group(1), shape, opcode, operands, args, attrs))
    return computations, entry, partitions


def _group_size(attrs: str, partitions: int | None) -> int | None:
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]", attrs)
    if mesh:
        sizes = dict(
            (name, int(size)) for name, size in re.findall(r"'([^']+)'\s*=\s*(\d+)", mesh.group(1))
        )
        axes = re.search(r"\{\s*('[^}]*)\}", attrs[mesh.end() :])
        if axes is None:
            return math.prod(sizes.values()) if sizes else partitions
        return math.prod(sizes[a] for a in re.findall(r"'([^']+)'", axes.group(1)))
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=", attrs)
    if iota:
        return int(iota.group(1).split(",")[-1])
    explicit = re.search(r"replica_groups=\{\{([^}]*)\}", attrs)
    if explicit:
        return len(explicit.group(1).split(","))
    if "replica_groups={}" in attrs:
        return partitions
    return None


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """``<=[dims]T(perm)``: iota over ``dims``, transposed by ``perm``."""
    ids = np.arange(math.prod(int(d) for d in dims.split(","))).reshape(
        [int(d) for d in dims.split(",")]
    )
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def replica_groups(attrs: str, partitions: int | None = None) -> tuple[tuple[int, ...], ...] | None:
    """The replica groups of one instruction's attributes: explicit, iota or mesh form.

    Example:
      >>> replica_groups("replica_groups=[4,2]<=[2,4]T(1,0)")
      ((0, 4), (1, 5), (2, 6), (3, 7))
    """
    m = re.search(r"replica_groups=(\{\{[\d,{}\s]*\}\})", attrs)
    if m:
        return tuple(
            tuple(int(v) for v in g.split(",") if v.strip())
            for g in re.findall(r"\{([\d,\s]*)\}", m[1])
        )
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        ids = _iota(m[3], m[4]).reshape(int(m[1]), int(m[2]))
        return tuple(tuple(int(v) for v in row) for row in ids)
    m = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
        r" \{([^}]*)\}",
        attrs,
    )
    if m:
        axes = [(a, int(n)) for a, n in re.findall(r"'([^']+)'\s*=\s*(\d+)", m[1])]
        sizes = [n for _, n in axes]
        ids = _iota(m[2], m[3]) if m[2] else np.arange(math.prod(sizes))
        ids = ids.reshape(sizes)
        group = [i for i, (a, _) in enumerate(axes) if f"'{a}'" in m[4]]
        rest = [i for i in range(len(axes)) if i not in group]
        k = math.prod(sizes[i] for i in group)
        rows = ids.transpose(rest + group).reshape(-1, k)
        return tuple(tuple(int(v) for v in row) for row in rows)
    if "replica_groups={}" in attrs and partitions:
        return (tuple(range(partitions)),)
    return None


def _callees(inst: _Instruction) -> list[tuple[str, str]]:
    """(attribute, computation) pairs this instruction calls."""
    out = [(attr, name) for attr, name in _CALLEES.findall(inst.attrs)]
    for group in _BRANCHES.findall(inst.attrs):
        out += [("branch", name) for name in re.findall(r"%?([\w.\-]+)", group)]
    return out


def _trip_count(inst: _Instruction) -> int | None:
    found = _TRIP.search(inst.attrs)
    if found:
        return int(found.group(1))
    config = re.search(r"backend_config=(\{.*\})", inst.attrs)
    if config:
        try:
            n = json.loads(config.group(1)).get("known_trip_count", {}).get("n")
        except (ValueError, AttributeError):
            n = None
        if n is not None:
            return int(n)
    return None


def _kind(opcode: str) -> tuple[str | None, str]:
    """(collective kind or None, '' | 'start' | 'done')."""
    for suffix in ("-start", "-done"):
        if opcode.endswith(suffix) and opcode[: -len(suffix)] in _ALL_KINDS:
            return opcode[: -len(suffix)], suffix[1:]
    return (opcode, "") if opcode in _ALL_KINDS else (None, "")


class _Module:
    def __init__(self, text: str) -> None:
        self.computations, self.entry, self.partitions = _parse(text)
        self.by_name: dict[str, dict[str, _Instruction]] = {
            comp: {i.name: i for i in insts} for comp, insts in self.computations.items()
        }
        self.users: dict[str, dict[str, list[_Instruction]]] = {}
        for comp, insts in self.computations.items():
            table: dict[str, list[_Instruction]] = {}
            for inst in insts:
                for op in inst.operands:
                    table.setdefault(op, []).append(inst)
            self.users[comp] = table

    def operand_bytes(self, comp: str, inst: _Instruction) -> int:
        table = self.by_name[comp]
        return sum(shape_bytes(table[op].shape) for op in inst.operands if op in table)

    def operand_shapes(self, comp: str, inst: _Instruction) -> list[str | None]:
        """The shape of each operand: printed inline (``f32[4,8]{1,0} %x``), else the
        shape of the instruction of that name in ``comp``; None when neither says."""
        shapes: list[str | None] = []
        table = self.by_name[comp]
        for piece in _tuple_elements(f"({inst.args})"):
            head, _, name = piece.strip().rpartition(" ")
            if head.strip():
                shapes.append(head.strip())
            else:
                found = table.get(name.lstrip("%"))
                shapes.append(found.shape if found is not None else None)
        return shapes

    def only_sliced(self, comp: str, name: str, depth: int = 0) -> bool:
        """Whether every use of value ``name`` reads it through a dynamic-slice.

        Follows bitcasts, copies, reshapes and transposes, and parameters of fusions.
        """
        users = self.users[comp].get(name, [])
        if not users or depth > 8:
            return False
        for user in users:
            if user.opcode == "dynamic-slice":
                if user.operands[0] != name:
                    return False
            elif user.opcode in _PASS_THROUGH:
                if not self.only_sliced(comp, user.name, depth + 1):
                    return False
            elif user.opcode == "fusion":
                callee = dict(_callees(user)).get("calls")
                if callee not in self.computations:
                    return False
                for position, op in enumerate(user.operands):
                    if op != name:
                        continue
                    param = self.parameters(callee).get(position)
                    if param is None or not self.only_sliced(callee, param, depth + 1):
                        return False
            else:
                return False
        return True

    def parameters(self, comp: str) -> dict[int, str]:
        """Parameter number -> instruction name in a computation."""
        return {
            int(i.args.strip()): i.name
            for i in self.computations[comp]
            if i.opcode == "parameter" and i.args.strip().isdigit()
        }

    def sliced_bytes(self, comp: str, inst: _Instruction) -> int:
        """Bytes of an all-reduce's result used only through dynamic-slice."""
        elements = _tuple_elements(inst.shape)
        if len(elements) == 1 and not inst.shape.lstrip().startswith("("):
            return shape_bytes(inst.shape) if self.only_sliced(comp, inst.name) else 0
        picks: dict[int, list[_Instruction]] = {}
        for user in self.users[comp].get(inst.name, []):
            found = re.search(r"\bindex=(\d+)", user.attrs)
            if user.opcode != "get-tuple-element" or found is None:
                return 0  # the tuple itself is used
            picks.setdefault(int(found.group(1)), []).append(user)
        total = 0
        for index, element in enumerate(elements):
            gtes = picks.get(index, [])
            if gtes and all(self.only_sliced(comp, g.name) for g in gtes):
                total += shape_bytes(element)
        return total

    def walk(self) -> list[Collective]:
        out: list[Collective] = []
        for comp, inst, weight, known in self.visit():
            kind, phase = _kind(inst.opcode)
            if kind is not None and phase != "done":
                out.append(self._collective(comp, inst, kind, phase, weight, known))
        return out

    def visit(
        self, start: str | None = None, *, branches: bool = True
    ) -> Iterator[tuple[str, _Instruction, int, bool]]:
        """(computation, instruction, executions per run, trip counts known) of every
        instruction reachable from ``start`` (default: the entry), each in every computation
        that reaches it; without ``branches``, not those reached through a conditional."""
        start = self.entry if start is None else start
        if start is None:
            return iter(())
        return self._visit(start, 1, True, frozenset(), branches)

    def _visit(
        self, comp: str, weight: int, known: bool, stack: frozenset, branches: bool = True
    ) -> Iterator[tuple[str, _Instruction, int, bool]]:
        if comp not in self.computations or comp in stack:
            return
        stack = stack | {comp}
        for inst in self.computations[comp]:
            yield comp, inst, weight, known
            _, phase = _kind(inst.opcode)
            if phase == "done" or inst.opcode in ("async-update", "async-done"):
                continue
            if inst.opcode == "conditional" and not branches:
                continue
            trip = _trip_count(inst) if inst.opcode == "while" else None
            for attr, callee in _callees(inst):
                if inst.opcode == "while" and attr in ("body", "condition"):
                    inner = (trip if trip is not None else 1) + (attr == "condition")
                    deeper = known and trip is not None
                    yield from self._visit(callee, weight * inner, deeper, stack, branches)
                else:
                    yield from self._visit(callee, weight, known, stack, branches)

    def _collective(self, comp, inst, kind, phase, weight, known) -> Collective:
        operand_bytes = self.operand_bytes(comp, inst)
        result = inst
        if phase == "start":
            done = [u for u in self.users[comp].get(inst.name, []) if u.opcode == f"{kind}-done"]
            result = done[0] if done else None
        if result is not None:
            result_bytes = shape_bytes(result.shape)
        else:  # a start without its done: the largest element of the start's tuple
            result_bytes = max((shape_bytes(e) for e in _tuple_elements(inst.shape)), default=0)
        sliced = 0
        if kind == "all-reduce" and result is not None:
            sliced = self.sliced_bytes(comp, result)
        return Collective(
            kind=kind,
            name=inst.name,
            weight=weight,
            bytes=max(operand_bytes, result_bytes),
            group_size=_group_size(inst.attrs, self.partitions),
            groups=replica_groups(inst.attrs, self.partitions),
            sliced_bytes=sliced,
            trip_count_known=known,
        )


def _tuple_elements(shape: str) -> list[str]:
    """Top-level elements of a tuple shape string (the shape itself if not a tuple)."""
    shape = re.sub(r"/\*.*?\*/", "", shape.strip())
    if not shape.startswith("("):
        return [shape]
    parts, depth, current = [], 0, ""
    for ch in shape[1:-1]:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        parts.append(current.strip())
    return parts


@dataclasses.dataclass(frozen=True)
class Contraction:
    """One ``dot`` or ``convolution`` instruction of a compiled program.

    Attributes:
      opcode: ``"dot"`` or ``"convolution"``.
      name: the instruction's name in the HLO text.
      flops: floating-point operations of one execution (a multiply-add counts 2).
      weight: executions per run of the program (product of enclosing trip counts).
      trip_count_known: False when an enclosing while loop has no ``known_trip_count``
        (the loop is then counted once).
    """

    opcode: str
    name: str
    flops: int
    weight: int
    trip_count_known: bool = True


def _dims(shape: str | None) -> list[int] | None:
    """The dimensions of an array shape string (a dynamic ``<=N`` counts N)."""
    found = _ARRAY.search(re.sub(r"/\*.*?\*/", "", shape or ""))
    if found is None:
        return None
    return [int(d.strip().replace("<=", "")) for d in found.group(2).split(",") if d.strip()]


def _contraction_flops(module: _Module, comp: str, inst: _Instruction) -> int:
    out = _dims(inst.shape)
    shapes = module.operand_shapes(comp, inst)
    if inst.opcode == "dot":
        lhs = _dims(shapes[0]) if shapes else None
        if out is None or lhs is None:
            raise ValueError(
                f"dot {inst.name!r}: cannot read the shape of its result or of its lhs "
                f"operand {inst.args!r}; pass the HLO module text whole."
            )
        found = re.search(r"\blhs_contracting_dims=\{([\d,\s]*)\}", inst.attrs)
        axes = [int(a) for a in found.group(1).split(",") if a.strip()] if found else []
        return 2 * math.prod(out) * math.prod(lhs[a] for a in axes)
    kernel = _dims(shapes[1]) if len(shapes) > 1 else None
    labels = re.search(r"\bdim_labels=\w+_(\w+)->\w+", inst.attrs)
    if out is None or kernel is None or labels is None or "o" not in labels.group(1):
        raise ValueError(
            f"convolution {inst.name!r}: cannot read its result shape, its kernel's shape "
            f"or the kernel's output feature dimension from dim_labels ({inst.attrs!r}); "
            "pass the HLO module text whole."
        )
    features = kernel[labels.group(1).index("o")]
    return 2 * math.prod(out) * math.prod(kernel) // max(features, 1)


def contractions(text: str) -> list[Contraction]:
    """Every ``dot`` and ``convolution`` reachable from the entry of an HLO module text.

    See :func:`dot_flops` for how each is counted and weighted.

    Example:
      >>> text = '''
      ... ENTRY %main (a: f32[8,16], b: f32[16,4]) -> f32[8,4] {
      ...   %a = f32[8,16]{1,0} parameter(0)
      ...   %b = f32[16,4]{1,0} parameter(1)
      ...   ROOT %d = f32[8,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
      ... }
      ... '''
      >>> contractions(text)
      [Contraction(opcode='dot', name='d', flops=1024, weight=1, trip_count_known=True)]
    """
    module = _Module(text)
    return [
        Contraction(inst.opcode, inst.name, _contraction_flops(module, comp, inst), weight, known)
        for comp, inst, weight, known in module.visit()
        if inst.opcode in ("dot", "convolution")
    ]


def dot_flops(text: str) -> float:
    """Floating-point operations per device of one run, from every dot and convolution.

    ``text`` is optimised HLO (``jax.jit(f).lower(...).compile().as_text()``); after SPMD
    partitioning its shapes are one device's, so this is per device.

      * a ``dot``: 2 x (elements of the result, batch dimensions included) x (product of
        the lhs operand's ``lhs_contracting_dims``);
      * a ``convolution``: 2 x (elements of the result) x (kernel elements / the kernel's
        output feature count), the kernel's ``o`` dimension in ``dim_labels`` (such as
        ``b01f_01io->b01f``): the multiply-adds of one output element. Every tap of the
        window counts, padding included (XLA's cost analysis leaves out taps that fall
        in padding, so it reports less for a padded convolution).

    Each is weighted by its executions per run: 1 in the entry computation, times the
    ``known_trip_count`` of every enclosing ``while`` body (its condition runs once more),
    and counted in every computation reached through ``fusion`` (``calls=``), ``call``
    (``to_apply=``), ``while`` (body and condition), async wrappers (``async-start``) and
    ``conditional``. Every branch of a conditional counts once: an upper bound when a
    branch is skipped. A while loop without ``known_trip_count`` counts its body once
    (:func:`contractions` marks those with ``trip_count_known=False``).

    ``compiled.cost_analysis()["flops"]`` counts a loop body once, whatever its trip
    count, and adds elementwise work; this counts what a scan or a pipeline schedule
    really runs. Matmuls a backend rewrote into custom calls (cuBLAS ``__cublas$gemm``,
    oneDNN) are not ``dot`` instructions and are not counted.

    Raises:
      ValueError: a dot's lhs or a convolution's kernel shape cannot be read.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> text = jax.jit(jnp.matmul).lower(jnp.ones((8, 16)), jnp.ones((16, 4))).compile()
      >>> dot_flops(text.as_text())
      1024.0
    """
    return float(sum(c.flops * c.weight for c in contractions(text)))


@dataclasses.dataclass(frozen=True)
class Conditional:
    """One ``conditional`` instruction of a compiled program (``lax.cond`` / ``lax.switch``).

    Attributes:
      name: the instruction's name in the HLO text.
      weight: executions per run (product of enclosing trip counts).
      branch_flops: dot and convolution FLOPs of one execution of each branch, in
        ``lax.switch`` index order (``lax.cond``: ``(false, true)``). A conditional nested
        inside a branch counts every one of its branches (an upper bound).
      trip_count_known: False when an enclosing while loop has no ``known_trip_count``.
    """

    name: str
    weight: int
    branch_flops: tuple[int, ...]
    trip_count_known: bool = True


def _branches(inst: _Instruction) -> list[str]:
    """The branch computations of a conditional, in index order (false first for a pred)."""
    found = _BRANCHES.search(inst.attrs)
    if found:
        return re.findall(r"%?([\w.\-]+)", found.group(1))
    named = dict(_CALLEES.findall(inst.attrs))
    return [named["false_computation"], named["true_computation"]]


def _flops(module: _Module, start: str | None = None, *, branches: bool = True) -> int:
    return sum(
        _contraction_flops(module, comp, inst) * weight
        for comp, inst, weight, _ in module.visit(start, branches=branches)
        if inst.opcode in ("dot", "convolution")
    )


def conditionals(text: str) -> list[Conditional]:
    """The conditionals that are not inside another conditional's branch, with the dot
    FLOPs of each branch: weight them by how often a schedule takes each branch.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> f = lambda p, x: jax.lax.cond(p, lambda x: x @ x, lambda x: x, x)
      >>> text = jax.jit(f).lower(True, jnp.ones((4, 4))).compile().as_text()
      >>> [c.branch_flops for c in conditionals(text)]
      [(0, 128)]
    """
    module = _Module(text)
    return [
        Conditional(inst.name, weight, tuple(_flops(module, b) for b in _branches(inst)), known)
        for comp, inst, weight, known in module.visit(branches=False)
        if inst.opcode == "conditional"
    ]


def unconditional_flops(text: str) -> float:
    """Dot and convolution FLOPs per device of one run outside every conditional's branches
    (weighted by loop trips as :func:`dot_flops`)."""
    return float(_flops(_Module(text), branches=False))


def executed_flops(text: str, taken: Callable[[Conditional], Sequence[float]]) -> float:
    """Dot FLOPs per device of one run when the conditionals' taken branches are known.

    ``taken(conditional)`` returns how many of the conditional's ``weight`` executions
    run each branch (in :attr:`Conditional.branch_flops` order); the counts must add up
    to ``weight``. Pipeline schedules know them per stage
    (:func:`jfleet.parallel.pipeline_schedule.stage_ticks`).

    Raises:
      ValueError: counts of the wrong length or not adding up to the weight.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> f = lambda p, x: jax.lax.cond(p, lambda x: x @ x, lambda x: x, x)
      >>> text = jax.jit(f).lower(True, jnp.ones((4, 4))).compile().as_text()
      >>> executed_flops(text, lambda c: (1, 0)), executed_flops(text, lambda c: (0, 1))
      (0.0, 128.0)
    """
    total = unconditional_flops(text)
    for c in conditionals(text):
        counts = tuple(taken(c))
        if len(counts) != len(c.branch_flops) or abs(sum(counts) - c.weight) > 1e-9:
            raise ValueError(
                f"conditional {c.name!r} runs {c.weight} times with {len(c.branch_flops)} "
                f"branches; taken() returned {counts}: give one count per branch, adding up "
                f"to {c.weight}."
            )
        total += sum(n * f for n, f in zip(counts, c.branch_flops, strict=True))
    return float(total)


def collectives(text: str) -> list[Collective]:
    """Every collective reachable from the entry computation of an HLO module text."""
    return _Module(text).walk()


def summarize(items: Iterable[Collective] | str) -> dict[str, KindSummary]:
    """Per-kind totals (count and bytes weighted by executions); every kind in :data:`KINDS`.

    Accepts the HLO text itself or the list :func:`collectives` returned.
    """
    if isinstance(items, str):
        items = collectives(items)
    totals: dict[str, list] = {k: [0, 0, 0.0, 0] for k in KINDS}
    for c in items:
        t = totals.setdefault(c.kind, [0, 0, 0.0, 0])
        t[0] += c.weight
        t[1] += c.weight * c.bytes
        t[2] += c.weight * c.wire_bytes
        t[3] += c.weight * c.sliced_bytes
    return {
        k: KindSummary(count=v[0], bytes=v[1], wire_bytes=v[2], sliced_bytes=v[3])
        for k, v in totals.items()
    }


def signature(text: str) -> dict[str, tuple[int, int]]:
    """``{kind: (count, bytes)}`` for the kinds present: compare two programs' collectives."""
    return {k: (s.count, s.bytes) for k, s in summarize(text).items() if s.count}


def instruction_count(text: str) -> int:
    """How many instructions the program's computations hold, each counted once (not
    weighted by trip counts): the size of the compiled program, which grows with unrolled
    code and stays flat under a loop.

    Example:
      >>> instruction_count('''
      ... ENTRY %main (p: f32[8]) -> f32[8] {
      ...   %p = f32[8]{0} parameter(0)
      ...   ROOT %n = f32[8]{0} negate(%p)
      ... }
      ... ''')
      2
    """
    return sum(len(instructions) for instructions in _parse(text)[0].values())
