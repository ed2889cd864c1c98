"""The rendezvous' messages, checked field by field: what a node or the master may say.

Every message read by the master or by a node goes through :func:`check` before it is used:
types, ranges (ports 1..65535, node ranks, exit codes 0..255), hosts that are hostnames or
IP literals (never ``host:port`` or lists), bounded strings and lists. A message that fails
raises :class:`BadMessageError`, which the reader logs with the peer's address and drops.

Example:
  >>> check({"type": "register", "host": "10.0.0.2", "nproc": 1, "ports": [7001], "rank": -1},
  ...       nnodes=2)["ports"]
  [7001]
  >>> check_host("127.0.0.1:1,10.6.6.6")
  Traceback (most recent call last):
  ...
  jfleet.launch.schema.BadMessageError: host '127.0.0.1:1,10.6.6.6' is not a hostname or an IP...
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from typing import Any

__all__ = ["BadMessageError", "Node", "check", "check_host"]

#: Workers one node may run (a sanity bound on ``nproc``).
MAX_NPROC = 4096
#: Lines of a failed worker's log carried in a failure, and characters per line.
MAX_TAIL_LINES, MAX_TEXT = 50, 2000
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


class BadMessageError(ValueError):
    """A message that does not follow the rendezvous' schema."""


def check_host(host: Any) -> str:
    """``host`` when it is a hostname (RFC 1123) or an IPv4 / IPv6 literal.

    Raises:
      BadMessageError: anything else (a port, a list, spaces, an empty string).

    Example:
      >>> check_host("node-1.cluster"), check_host("::1")
      ('node-1.cluster', '::1')
    """
    if isinstance(host, str) and 0 < len(host) <= 253:
        try:
            return str(ipaddress.ip_address(host))
        except ValueError:
            labels = host.removesuffix(".").split(".")
            if all(_LABEL.fullmatch(label) for label in labels) and not labels[-1].isdigit():
                return host
    raise BadMessageError(f"host {host!r} is not a hostname or an IP address")


def _int(d: dict[str, Any], key: str, low: int, high: int) -> int:
    value = d.get(key)
    if type(value) is not int or not low <= value <= high:
        raise BadMessageError(f"{key}={value!r} is not an integer in {low}..{high}")
    return value


def _text(value: Any, key: str, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise BadMessageError(f"{key} is not a string of at most {MAX_TEXT} characters")
    return value


@dataclasses.dataclass(frozen=True)
class Node:
    """A node as the job sees it: the host others reach it at, its workers, their ports."""

    host: str
    nproc: int
    ports: tuple[int, ...]

    @classmethod
    def from_json(cls, d: Any) -> Node:
        """A node from its JSON form, checked.

        Raises:
          BadMessageError: a field missing, of the wrong type or out of range.
        """
        if not isinstance(d, dict):
            raise BadMessageError(f"a node is a JSON object, not {type(d).__name__}")
        nproc = _int(d, "nproc", 1, MAX_NPROC)
        ports = d.get("ports")
        if (
            not isinstance(ports, list)
            or len(ports) != nproc
            or any(type(p) is not int or not 0 < p < 65536 for p in ports)
            or len(set(ports)) != len(ports)
        ):
            raise BadMessageError(f"ports={ports!r} is not {nproc} distinct ports in 1..65535")
        return cls(check_host(d.get("host")), nproc, tuple(ports))

    def to_json(self) -> dict[str, Any]:
        """The node's JSON form (what :meth:`from_json` reads)."""
        return {"host": self.host, "nproc": self.nproc, "ports": list(self.ports)}


def _failure(f: Any) -> dict[str, Any]:
    if not isinstance(f, dict):
        raise BadMessageError("failure is not a JSON object")
    out: dict[str, Any] = {
        "what": _text(f.get("what"), "failure.what"),
        "exit_code": _int(f, "exit_code", 0, 255),
    }
    for key in ("rank", "node_rank", "returncode"):
        if key in f:
            out[key] = _int(f, key, -255, 1 << 31)
    if "log" in f:
        out["log"] = _text(f["log"], "failure.log")
    if "interrupted" in f:
        out["interrupted"] = f["interrupted"] is True
    if "tail" in f:
        tail = f["tail"]
        if not isinstance(tail, list) or len(tail) > MAX_TAIL_LINES:
            raise BadMessageError(f"failure.tail is not a list of at most {MAX_TAIL_LINES} lines")
        out["tail"] = [_text(line, "failure.tail line") for line in tail]
    return out


def check(message: Any, *, nnodes: int) -> dict[str, Any]:
    """``message`` checked against the schema of its type (a clean copy).

    Raises:
      BadMessageError: an unknown type, or a field missing, mistyped or out of range.
    """
    if not isinstance(message, dict):
        raise BadMessageError(f"a message is a JSON object, not {type(message).__name__}")
    kind = message.get("type")
    if kind == "register":
        node = Node.from_json(message)
        rank = _int(message, "rank", -1, nnodes - 1)
        return {"type": kind, **node.to_json(), "rank": rank}
    if kind in ("done", "stopped"):
        return {"type": kind}
    if kind in ("failed", "stop"):
        return {"type": kind, "failure": _failure(message.get("failure"))}
    if kind == "restart":
        return {"type": kind, "attempt": _int(message, "attempt", 1, 1 << 31)}
    if kind == "start":
        nodes = message.get("nodes")
        if not isinstance(nodes, list) or len(nodes) != nnodes:
            raise BadMessageError(f"nodes is not a list of {nnodes} nodes")
        listing = [Node.from_json(n) for n in nodes]
        endpoints = [(n.host, p) for n in listing for p in n.ports]
        if len(set(endpoints)) != len(endpoints):
            raise BadMessageError("two workers share an endpoint")
        return {
            "type": kind,
            "attempt": _int(message, "attempt", 0, 1 << 31),
            "node_rank": _int(message, "node_rank", 0, nnodes - 1),
            "nodes": [n.to_json() for n in listing],
        }
    if kind == "end":
        failure = message.get("failure")
        return {
            "type": kind,
            "code": _int(message, "code", 0, 255),
            "failure": None if failure is None else _failure(failure),
            "error": _text(message.get("error"), "error", optional=True),
        }
    raise BadMessageError(f"unknown message type {kind!r}")
