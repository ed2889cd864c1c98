"""A tiny reader and writer for protobuf's text format, enough for strategy files.

``DistributedStrategy.save_to_prototxt`` / ``load_from_prototxt`` use it; there is no
protobuf dependency. The writer emits::

    amp: true
    amp_configs {
      init_loss_scaling: 32768.0
      custom_white_list: "matmul"
      custom_black_list: []
    }

The reader accepts that, Paddle's own output (``str(proto)``), ``#`` comments, an
optional ``:`` before a ``{`` block, ``[a, b]`` lists, repeated ``name: value`` lines for
list fields, and ``,`` or ``;`` between fields. It returns untyped :class:`Entry` trees;
typing them against a schema is the caller's job. Errors are :class:`PrototxtError`
(a ``ValueError``) naming the line; blocks nest at most :data:`MAX_DEPTH` deep.

Example:
  >>> parse("a { b: 1 }")[0].value[0].value.text
  '1'
  >>> parse("a {" * 100)
  Traceback (most recent call last):
  ...
  jfleet.training.prototxt.PrototxtError: line 1: blocks nested more than 32 deep; ...
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any


class PrototxtError(ValueError):
    """A text-format file that cannot be read; the message names the line."""


@dataclass(frozen=True)
class Scalar:
    """One scalar token: its text, whether it was a quoted string, and its line."""

    text: str
    quoted: bool
    line: int


@dataclass(frozen=True)
class Entry:
    """One field occurrence: ``name: scalar``, ``name: [scalars]`` or ``name { entries }``.

    ``kind`` is ``"scalar"`` (value: :class:`Scalar`), ``"list"`` (value: a list of
    :class:`Scalar`) or ``"block"`` (value: a list of :class:`Entry`).
    """

    name: str
    line: int
    kind: str
    value: Any


_TOKEN = re.compile(
    r"""(?P<nl>\n)|(?P<ws>[ \t\r\f\v]+)|(?P<comment>\#[^\n]*)
    |(?P<str>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
    |(?P<punct>[:{}\[\],;])|(?P<word>[^\s:{}\[\],;"'#]+)|(?P<bad>.)""",
    re.VERBOSE,
)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: The deepest nesting of blocks read (a strategy file nests three levels).
MAX_DEPTH = 32


@dataclass(frozen=True)
class _Tok:
    kind: str
    text: str
    line: int


def _tokenize(text: str) -> list[_Tok]:
    tokens, line = [], 1
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup
        if kind == "nl":
            line += 1
        elif kind == "bad" and m.group() in "\"'":
            raise PrototxtError(f"line {line}: a string opened here is never closed.")
        elif kind == "bad":
            raise PrototxtError(f"line {line}: unexpected character {m.group()!r}.")
        elif kind not in ("ws", "comment"):
            tokens.append(_Tok(kind, m.group(), line))
    return tokens


class _Parser:
    def __init__(self, tokens: list[_Tok]) -> None:
        self._tokens = tokens
        self._pos = 0
        self._depth = 0

    def _peek(self) -> _Tok | None:
        return self._tokens[self._pos] if self._pos < len(self._tokens) else None

    def _take(self) -> _Tok:
        tok = self._tokens[self._pos]
        self._pos += 1
        return tok

    def _is(self, tok: _Tok | None, text: str) -> bool:
        return tok is not None and tok.kind == "punct" and tok.text == text

    def block(self, opened_at: int | None) -> list[Entry]:
        entries: list[Entry] = []
        while True:
            tok = self._peek()
            if tok is None:
                if opened_at is None:
                    return entries
                raise PrototxtError(
                    f"line {opened_at}: the block opened here is never closed; add a '}}'."
                )
            if self._is(tok, "}"):
                if opened_at is None:
                    raise PrototxtError(f"line {tok.line}: '}}' closes no open block.")
                self._take()
                return entries
            if self._is(tok, ",") or self._is(tok, ";"):
                self._take()
                continue
            if tok.kind != "word" or not _NAME.match(tok.text):
                raise PrototxtError(f"line {tok.line}: expected a field name, got {tok.text!r}.")
            entries.append(self._field(self._take()))

    def _field(self, name: _Tok) -> Entry:
        tok = self._peek()
        colon = self._is(tok, ":")
        if colon:
            self._take()
            tok = self._peek()
        if self._is(tok, "{"):
            self._take()
            if self._depth >= MAX_DEPTH:
                raise PrototxtError(
                    f"line {tok.line}: blocks nested more than {MAX_DEPTH} deep; a strategy "
                    "file nests a few levels: check the braces (is a '}' missing?)."
                )
            self._depth += 1
            entries = self.block(tok.line)
            self._depth -= 1
            return Entry(name.text, name.line, "block", entries)
        if not colon:
            got = "the end of the file" if tok is None else repr(tok.text)
            raise PrototxtError(
                f"line {name.line}: expected ':' or '{{' after {name.text!r}, got {got}."
            )
        if self._is(tok, "["):
            self._take()
            return Entry(name.text, name.line, "list", self._list(name))
        return Entry(name.text, name.line, "scalar", self._scalar(name))

    def _scalar(self, name: _Tok) -> Scalar:
        tok = self._peek()
        if tok is None or tok.kind not in ("word", "str"):
            got = "the end of the file" if tok is None else repr(tok.text)
            raise PrototxtError(f"line {name.line}: expected a value for {name.text!r}, got {got}.")
        self._take()
        if tok.kind == "word":
            return Scalar(tok.text, False, tok.line)
        try:
            text = ast.literal_eval(tok.text)
        except (ValueError, SyntaxError):
            raise PrototxtError(f"line {tok.line}: bad string literal {tok.text}.") from None
        return Scalar(text, True, tok.line)

    def _list(self, name: _Tok) -> list[Scalar]:
        items: list[Scalar] = []
        while True:
            tok = self._peek()
            if self._is(tok, "]"):
                self._take()
                return items
            if items:
                if not self._is(tok, ","):
                    got = "the end of the file" if tok is None else repr(tok.text)
                    raise PrototxtError(
                        f"line {name.line}: list {name.text!r} expects ',' or ']', got {got}."
                    )
                self._take()
            items.append(self._scalar(name))


def parse(text: str) -> list[Entry]:
    """Parses text-format ``text`` into a list of top-level :class:`Entry`.

    Raises:
      PrototxtError: the text is not well-formed; the message names the line.
    """
    return _Parser(_tokenize(text)).block(None)


def to_bool(s: Scalar) -> bool:
    """The bool a scalar spells (``true``/``false``, ``True``/``False``, ``t``/``f``, 1/0)."""
    if not s.quoted and s.text in ("true", "True", "t", "1"):
        return True
    if not s.quoted and s.text in ("false", "False", "f", "0"):
        return False
    raise PrototxtError(f"line {s.line}: expected true or false, got {s.text!r}.")


def to_int(s: Scalar) -> int:
    """The int a scalar spells (decimal, optionally signed)."""
    if not s.quoted and re.fullmatch(r"[+-]?\d+", s.text):
        return int(s.text)
    raise PrototxtError(f"line {s.line}: expected an integer, got {s.text!r}.")


def to_float(s: Scalar) -> float:
    """The float a scalar spells (``1``, ``0.5``, ``1e-05``, ``0.5f``, ``inf``, ``nan``)."""
    text = s.text
    if not s.quoted and text[-1:] in "fF" and not text.lower().endswith("inf"):
        text = text[:-1]
    try:
        if s.quoted or not text:
            raise ValueError
        return float(text)
    except ValueError:
        raise PrototxtError(f"line {s.line}: expected a number, got {s.text!r}.") from None


def to_str(s: Scalar) -> str:
    """The string of a quoted scalar."""
    if s.quoted:
        return s.text
    raise PrototxtError(f"line {s.line}: expected a quoted string, got {s.text}; add quotes.")


def _format_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    raise TypeError(f"cannot write {value!r} of type {type(value).__name__} as text format.")


def _dump_lines(values: Mapping[str, Any], indent: str) -> Iterator[str]:
    for name, value in values.items():
        if isinstance(value, Mapping):
            yield f"{indent}{name} {{"
            yield from _dump_lines(value, indent + "  ")
            yield f"{indent}}}"
        elif isinstance(value, list | tuple):
            if not value:
                yield f"{indent}{name}: []"
            for item in value:
                if isinstance(item, Mapping):
                    yield f"{indent}{name} {{"
                    yield from _dump_lines(item, indent + "  ")
                    yield f"{indent}}}"
                else:
                    yield f"{indent}{name}: {_format_scalar(item)}"
        else:
            yield f"{indent}{name}: {_format_scalar(value)}"


def dump(values: Mapping[str, Any], header: str = "") -> str:
    """Writes nested ``values`` (dicts, lists, bool/int/float/str) as text format.

    Dicts become ``name { ... }`` blocks, a list one ``name: item`` line (or block) per
    item, an empty list ``name: []``. ``header`` lines are written as ``#`` comments.
    """
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    lines.extend(_dump_lines(values, ""))
    return "\n".join(lines) + "\n"
