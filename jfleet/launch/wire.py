"""Authenticated JSON-lines connections of the rendezvous: handshakes, bounded reads.

:func:`admit` (the master's side) and :func:`join` (a node's side) run the handshake of
:mod:`jfleet.launch.auth` on a fresh socket within :data:`HANDSHAKE_TIMEOUT_S`; a
:class:`Connection` then carries signed lines, each at most :data:`MAX_LINE` bytes. Its
reader thread checks every line (signature, sequence, :mod:`jfleet.launch.schema`) and puts
``(tag, message)`` on an inbox, ``(tag, None)`` when the peer is gone or sent something
that does not pass (after reporting it, with the peer's address, to ``on_bad``).

Example:
  >>> import socket, threading
  >>> a, b = socket.socketpair()
  >>> token = b"0123456789abcdef"
  >>> box = []
  >>> t = threading.Thread(target=lambda: box.append(admit(a, token)))
  >>> t.start(); node, _ = join(b, token, "test"); t.join()
  >>> master, _ = box[0]
  >>> master.open(node.seal({"type": "done"}))
  {'type': 'done'}
"""

from __future__ import annotations

import contextlib
import json
import queue
import socket
import threading
from collections.abc import Callable
from typing import Any

from jfleet.launch import schema
from jfleet.launch.auth import AuthError, Channel, mac, new_nonce, verify

__all__ = ["HANDSHAKE_TIMEOUT_S", "MAX_LINE", "Connection", "HandshakeError", "admit", "join"]

#: The longest line read (bytes); a longer one ends the connection.
MAX_LINE = 256 * 1024
#: Seconds a new connection has to complete its handshake.
HANDSHAKE_TIMEOUT_S = 5.0


class HandshakeError(ConnectionError):
    """The peer did not prove that it knows the job token.

    ``final`` is False when the connection merely ended or timed out (the master may have
    dropped it under load: worth another try), True when the peer answered wrongly.
    """

    def __init__(self, message: str, *, final: bool = False) -> None:
        super().__init__(message)
        self.final = final


class Lines:
    """Reads newline-terminated lines of at most :data:`MAX_LINE` bytes from a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self._file = sock.makefile("rb")

    def read(self) -> bytes | None:
        """The next non-empty line; None at the end of the stream.

        Raises:
          AuthError: a line longer than :data:`MAX_LINE`.
          OSError: the socket failed or timed out.
        """
        while True:
            line = self._file.readline(MAX_LINE + 1)
            if not line:
                return None
            if not line.endswith(b"\n"):
                if len(line) > MAX_LINE:
                    raise AuthError(f"a line longer than {MAX_LINE} bytes")
                return None  # the stream ended mid-line
            if line.strip():
                return line


def _send_raw(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall((json.dumps(message) + "\n").encode())


def _read_json(lines: Lines, what: str) -> dict[str, Any]:
    try:
        line = lines.read()
    except OSError:
        raise HandshakeError(f"no {what} within {HANDSHAKE_TIMEOUT_S:g} s") from None
    except AuthError as error:
        raise HandshakeError(str(error), final=True) from None
    if line is None:
        raise HandshakeError(f"the connection closed before the {what}")
    try:
        message = json.loads(line)
    except ValueError:
        raise HandshakeError(f"the {what} is not JSON", final=True) from None
    if not isinstance(message, dict):
        raise HandshakeError(f"the {what} is not a JSON object", final=True)
    return message


def _nonce(value: Any) -> str:
    if not isinstance(value, str) or len(value) != 32:
        raise HandshakeError("a malformed nonce", final=True)
    return value


def admit(sock: socket.socket, token: bytes) -> tuple[Channel, Lines]:
    """The master's side of the handshake on ``sock``: its channel and reader, once the node
    proved the token.

    Raises:
      HandshakeError: the node did not answer in time or did not prove the token.
    """
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    lines = Lines(sock)
    ns = new_nonce()
    try:
        _send_raw(sock, {"type": "hello", "nonce": ns})
    except OSError as error:
        raise HandshakeError(f"the node went away ({error})") from None
    reply = _read_json(lines, "auth")
    if reply.get("type") != "auth":
        raise HandshakeError("the first line is not an auth")
    nc = _nonce(reply.get("nonce"))
    if not verify(mac(token, "node", ns, nc), reply.get("mac")):
        with contextlib.suppress(OSError):  # say so: a node with another token stops
            _send_raw(sock, {"type": "denied"})
        raise HandshakeError("a wrong job token", final=True)
    try:
        _send_raw(sock, {"type": "welcome", "mac": mac(token, "master", nc, ns)})
    except OSError as error:
        raise HandshakeError(f"the node went away ({error})") from None
    sock.settimeout(None)
    return Channel.session(token, ns, nc, "master"), lines


def join(sock: socket.socket, token: bytes, master: str) -> tuple[Channel, Lines]:
    """A node's side of the handshake: checks that the master at ``master`` knows the token.

    Raises:
      HandshakeError: the master did not prove the token (a stranger holds the port, or
        the job tokens differ), named with ``master`` and the fix.
    """
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    lines = Lines(sock)
    fix = (
        f"the process at --master {master} is not this job's rendezvous (another program or "
        "job holds the port), or its launcher has another JFLEET_JOB_TOKEN; give every node "
        "the same token and a free --master port"
    )
    try:
        hello = _read_json(lines, "hello")
        if hello.get("type") != "hello":
            raise HandshakeError("the first line is not a hello", final=True)
        ns = _nonce(hello.get("nonce"))
        nc = new_nonce()
        _send_raw(sock, {"type": "auth", "nonce": nc, "mac": mac(token, "node", ns, nc)})
        welcome = _read_json(lines, "welcome")
    except (HandshakeError, OSError) as error:
        raise HandshakeError(f"{error}: {fix}.", final=getattr(error, "final", False)) from None
    if welcome.get("type") == "denied":
        raise HandshakeError(f"the master refused this launcher's job token: {fix}.", final=True)
    if welcome.get("type") != "welcome" or not verify(
        mac(token, "master", nc, ns), welcome.get("mac")
    ):
        raise HandshakeError(f"the master did not prove the job token: {fix}.", final=True)
    sock.settimeout(None)
    return Channel.session(token, ns, nc, "node"), lines


class Connection:
    """An authenticated socket: signed sends, a reader thread that checks what it reads.

    Args:
      sock: the socket, after :func:`admit` or :func:`join`.
      channel: its channel.
      lines: its reader.
      inbox: where ``(tag, message)`` go (``(tag, None)`` when the peer is gone).
      tag: the connection's name in the inbox.
      nnodes: the job's node count (for the schema).
      on_bad: called with ``(tag, reason)`` for a line that does not pass.
    """

    def __init__(
        self,
        sock: socket.socket,
        channel: Channel,
        lines: Lines,
        inbox: queue.Queue,
        tag: Any,
        *,
        nnodes: int,
        on_bad: Callable[[Any, str], None],
    ) -> None:
        self.sock = sock
        self._channel = channel
        self._lines = lines
        self._lock = threading.Lock()
        self._closed = False
        args = (inbox, tag, nnodes, on_bad)
        self._reader = threading.Thread(target=self._read, args=args, daemon=True)

    def start(self) -> Connection:
        """Starts reading (after the owner has filed the connection)."""
        self._reader.start()
        return self

    def _read(self, inbox: queue.Queue, tag: Any, nnodes: int, on_bad: Callable) -> None:
        try:
            while (line := self._lines.read()) is not None:
                message = schema.check(self._channel.open(line), nnodes=nnodes)
                inbox.put((tag, message))
        except (AuthError, schema.BadMessageError) as error:
            on_bad(tag, str(error))
        except OSError:
            pass
        self.close()
        inbox.put((tag, None))

    def send(self, message: dict[str, Any]) -> bool:
        """Sends one message; False when the peer is gone."""
        with self._lock:
            if self._closed:
                return False
            try:
                self.sock.sendall((self._channel.seal(message) + "\n").encode())
            except OSError:
                return False
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
