"""The rendezvous' trust: a job token, a handshake that proves it both ways, signed lines.

Every launcher of a multi-node job holds the same secret, the **job token**
(``$JFLEET_JOB_TOKEN``, or the first line of the file named by ``$JFLEET_JOB_TOKEN_FILE``;
at least 16 characters). A one-node job makes a random one itself: nothing to set.

A connection starts with a challenge each way (``docs/launch.md``, ``SECURITY.md``):

  master -> node   ``{"type": "hello", "nonce": Ns}``
  node -> master   ``{"type": "auth", "nonce": Nc, "mac": H(token, "node", Ns, Nc)}``
  master -> node   ``{"type": "welcome", "mac": H(token, "master", Nc, Ns)}``

so the master learns that the node knows the token and the node that the master does (a
process that took the ``--master`` port first cannot pass). After it, each line is
``{"seq": n, "body": "<json>", "mac": H(key, direction, n, body)}`` with a key derived from
the token and both nonces: a line from outside the connection, replayed, reordered or
altered fails its check. :class:`Channel` does the signing and checking.

Example:
  >>> token = b"0123456789abcdef"
  >>> node, master = Channel.session(token, "ns", "nc", "node"), Channel.session(
  ...     token, "ns", "nc", "master")
  >>> master.open(node.seal({"type": "done"}))
  {'type': 'done'}
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Mapping
from typing import Any

__all__ = [
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "AuthError",
    "Channel",
    "job_token",
    "mac",
    "new_nonce",
]

TOKEN_ENV = "JFLEET_JOB_TOKEN"
TOKEN_FILE_ENV = "JFLEET_JOB_TOKEN_FILE"
#: The shortest token accepted (characters).
MIN_TOKEN_CHARS = 16


class AuthError(ValueError):
    """A line that is not what an authenticated peer sends (bad MAC, sequence, JSON)."""


def _fix() -> str:
    example = secrets.token_hex(16)
    return (
        f"set the same secret on every node, e.g. export {TOKEN_ENV}={example} (or put it in "
        f"a file readable only by you and set {TOKEN_FILE_ENV}=<path>)"
    )


def job_token(environ: Mapping[str, str], *, nnodes: int) -> bytes:
    """The job's secret: from the environment, or random for a one-node job.

    Raises:
      ValueError: a multi-node job without a token, an unreadable token file, or a token
        shorter than :data:`MIN_TOKEN_CHARS`; the message names the variable and the fix.

    Example:
      >>> len(job_token({}, nnodes=1))
      32
      >>> job_token({"JFLEET_JOB_TOKEN": "0123456789abcdef"}, nnodes=2)
      b'0123456789abcdef'
    """
    raw, source = environ.get(TOKEN_ENV, "").strip(), TOKEN_ENV
    path = environ.get(TOKEN_FILE_ENV, "").strip()
    if not raw and path:
        source = f"{TOKEN_FILE_ENV}={path!r}"
        try:
            with open(path, encoding="utf-8") as f:
                raw = f.readline().strip()
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"{source}: cannot read the job token ({error}); {_fix()}.") from None
    if not raw:
        if nnodes == 1:
            return secrets.token_bytes(32)
        raise ValueError(
            f"a {nnodes}-node job needs a job token, so that only its own launchers can join "
            f"the rendezvous: {_fix()}."
        )
    if len(raw) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"{source}: the job token has {len(raw)} characters, fewer than {MIN_TOKEN_CHARS}; "
            f"{_fix()}."
        )
    return raw.encode()


def new_nonce() -> str:
    """A fresh random challenge (hex)."""
    return secrets.token_hex(16)


def mac(key: bytes, *parts: str) -> str:
    """HMAC-SHA256 of ``parts`` (joined unambiguously) under ``key``, hex.

    Example:
      >>> mac(b"k", "a", "b") == mac(b"k", "a", "b") != mac(b"k", "ab", "")
      True
    """
    data = b"\0".join(p.encode() for p in parts)
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def verify(expected: str, got: Any) -> bool:
    """Whether ``got`` is the string ``expected`` (constant time)."""
    return isinstance(got, str) and hmac.compare_digest(expected, got)


class Channel:
    """One side of an authenticated connection: signs what it sends, checks what it reads.

    Args:
      key: the session key (from :meth:`session`).
      side: ``"node"`` or ``"master"``: the direction of what this side sends.
    """

    def __init__(self, key: bytes, side: str) -> None:
        self._key = key
        self._out, self._in = (side, "master" if side == "node" else "node")
        self._sent = 0
        self._read = 0

    @classmethod
    def session(cls, token: bytes, master_nonce: str, node_nonce: str, side: str) -> Channel:
        """The channel of a connection whose handshake used these nonces."""
        key = bytes.fromhex(mac(token, "session", master_nonce, node_nonce))
        return cls(key, side)

    def seal(self, message: Mapping[str, Any]) -> str:
        """``message`` as one signed line (without the newline)."""
        self._sent += 1
        body = json.dumps(message)
        tag = mac(self._key, self._out, str(self._sent), body)
        return json.dumps({"seq": self._sent, "body": body, "mac": tag})

    def open(self, line: bytes | str) -> dict[str, Any]:
        """The message of a signed line.

        Raises:
          AuthError: not JSON, not a signed line, a bad MAC or an unexpected sequence number.
        """
        try:
            frame = json.loads(line)
        except ValueError:
            raise AuthError("not JSON") from None
        if not isinstance(frame, dict) or set(frame) != {"seq", "body", "mac"}:
            raise AuthError("not a signed line")
        seq, body = frame["seq"], frame["body"]
        if not isinstance(body, str) or type(seq) is not int:
            raise AuthError("not a signed line")
        if not verify(mac(self._key, self._in, str(seq), body), frame["mac"]):
            raise AuthError("bad MAC: not signed with this job's token")
        if seq != self._read + 1:
            raise AuthError(f"sequence {seq} after {self._read} (replayed or reordered)")
        self._read = seq
        message = json.loads(body)
        if not isinstance(message, dict):
            raise AuthError("the message is not a JSON object")
        return message
