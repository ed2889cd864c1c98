"""The job's key-value store: JAX's coordination service, as jfleet uses it.

With several processes, ``jax.distributed.initialize`` connects every process to one
coordination service (hosted by process 0). Besides starting the job it keeps a small
key-value store that every process can read and write without touching a device; jfleet
uses it for what must cross processes cheaply and out of band: fingerprints compared at
``fleet.init`` and on new batch shapes (:mod:`jfleet.consistency`), and the heartbeats and
fault reports of :mod:`jfleet.watchdog`.

Keys live under ``jfleet/``; values are JSON. In a single process (no service) every
function here is a no-op that says so: :func:`available` is False.

Example:
  >>> available()  # one process: no coordination service
  False
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
from typing import Any

PREFIX = "jfleet/"


def client() -> Any | None:
    """The coordination client of this process, or None without ``jax.distributed``."""
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover - private module moved
        return None
    return distributed.global_state.client


def available() -> bool:
    """Whether this process is connected to a coordination service."""
    return client() is not None


def _key(key: str) -> str:
    return key if key.startswith(PREFIX) else PREFIX + key


def put(key: str, value: Any) -> None:
    """Stores ``value`` (JSON-serialisable) under ``jfleet/<key>``, replacing an old value."""
    c = client()
    if c is None:
        return
    c.key_value_set(_key(key), json.dumps(value), allow_overwrite=True)


def try_get(key: str) -> Any | None:
    """The value under ``jfleet/<key>``, or None when it is not set (never waits)."""
    c = client()
    if c is None:
        return None
    try:
        raw = c.key_value_try_get(_key(key))
    except Exception:  # NOT_FOUND is raised as an exception
        return None
    return json.loads(raw)


def wait_get(key: str, timeout_s: float) -> Any:
    """The value under ``jfleet/<key>``, waiting up to ``timeout_s`` for it to be set.

    Raises:
      TimeoutError: nothing was stored under the key within ``timeout_s``.
    """
    c = client()
    if c is None:
        raise RuntimeError("no coordination service: jax.distributed is not initialised")
    try:
        raw = c.blocking_key_value_get(_key(key), int(max(timeout_s, 0.001) * 1000))
    except Exception as e:
        raise TimeoutError(f"no value under {_key(key)!r} within {timeout_s:g} s ({e})") from e
    return json.loads(raw)


def delete(key: str) -> None:
    """Removes ``jfleet/<key>`` (nothing happens when it is not set)."""
    c = client()
    if c is not None:
        c.key_value_delete(_key(key))


def get_dir(prefix: str) -> dict[str, Any]:
    """Every key under ``jfleet/<prefix>`` with its value (keys without the prefix)."""
    c = client()
    if c is None:
        return {}
    full = _key(prefix)
    out = {}
    for key, raw in c.key_value_dir_get(full):
        out[key[len(full) :].lstrip("/")] = json.loads(raw)
    return out


def bind_address(coordinator: str) -> str | None:
    """Where process 0's coordination service listens: the coordinator's own address,
    not every interface (JAX's default ``[::]:port``).

    None (JAX's default) when ``$JAX_COORDINATOR_BIND_ADDRESS`` is set (JAX reads it), when
    the host does not resolve, or when a host name resolves to a loopback address (as
    ``/etc/hosts`` often maps the machine's own name): binding that would shut out the
    other machines.

    Example:
      >>> bind_address("127.0.0.1:6170"), bind_address("[::1]:6170")
      ('127.0.0.1:6170', '[::1]:6170')
    """
    if os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", "").strip():
        return None
    host, _, port = coordinator.rpartition(":")
    host = host.strip("[]")
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    try:
        address = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0][4][0]
    except (OSError, ValueError):
        return None
    if literal is None and ipaddress.ip_address(address).is_loopback and host != "localhost":
        return None
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
