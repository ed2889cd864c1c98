"""Free ports for a job, held so that a second job on the host cannot take them.

A port is free when a plain ``bind`` succeeds (nothing bound or listening there). The
launcher then *holds* it: it binds it again with ``SO_REUSEPORT`` and keeps the socket
(never listening) until the job ends. Another launcher's free-port test fails on a held
port, so two jobs started at once on one host get different ports; the worker itself
can still bind a held port, because JAX's coordination service (gRPC) binds with
``SO_REUSEPORT`` too. Residual race: a program that is not a jfleet launcher and binds
with ``SO_REUSEPORT`` as the same user could share a held port; and between the test and
the hold (microseconds) any program could take it.

Example:
  >>> held = hold_free_ports(2)
  >>> len({h.port for h in held}), all(0 < h.port < 65536 for h in held)
  (2, True)
  >>> for h in held:
  ...     h.release()
"""

from __future__ import annotations

import socket

__all__ = ["HeldPort", "hold_free_ports", "is_free"]


class HeldPort:
    """A port bound (with ``SO_REUSEPORT``, not listening) until :meth:`release`."""

    def __init__(self, port: int, sock: socket.socket | None) -> None:
        self.port = port
        self._sock = sock

    def release(self) -> None:
        """Closes the holding socket (idempotent)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __repr__(self) -> str:
        return f"HeldPort({self.port}, held={self._sock is not None})"


def is_free(port: int) -> bool:
    """Whether a plain bind of ``port`` on every interface succeeds now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _hold(port: int) -> HeldPort | None:
    """Tests ``port`` (0: any) with a plain bind, then holds it; None when it is taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return None
        port = probe.getsockname()[1]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(("", port))
    except OSError:
        sock.close()
        return None
    return HeldPort(port, sock)


def hold_free_ports(n: int, *, start: int | None = None) -> list[HeldPort]:
    """``n`` free ports, each held: any free ones, or the first free from ``start`` up.

    Raises:
      RuntimeError: fewer than ``n`` free ports from ``start`` to 65535.
    """
    held: list[HeldPort] = []
    port = start
    while len(held) < n:
        if port is not None and port > 65535:
            for h in held:
                h.release()
            raise RuntimeError(
                f"--start_port={start}: only {len(held)} of the {n} ports needed are free "
                f"between {start} and 65535; give a lower --start_port or leave it out."
            )
        got = _hold(port or 0)
        if got is not None and all(h.port != got.port for h in held):
            held.append(got)
        elif got is not None:
            got.release()
        if port is not None:
            port += 1
    return held
