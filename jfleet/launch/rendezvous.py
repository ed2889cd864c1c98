"""The nodes' rendezvous: a tiny TCP service on node 0 that ranks nodes and ends the job.

Every launcher (node 0's included) connects to ``--master``, proves that it knows the job
token and checks that the master does (:mod:`jfleet.launch.auth`), then speaks signed JSON
lines (:mod:`jfleet.launch.wire`, each checked by :mod:`jfleet.launch.schema`):

  node -> master   ``register {host, nproc, ports, rank}``   (once per attempt)
  master -> node   ``start {attempt, node_rank, nodes}``       when all ``nnodes`` registered
  node -> master   ``done`` (its workers all exited 0) | ``failed {failure}`` | ``stopped``
  master -> node   ``stop {failure}`` (reap your workers) after the first failure,
                   then ``restart {attempt}`` (register again) or
                   ``end {code, failure, error}`` (exit with ``code``)

Node ranks: a launcher given ``--rank`` gets it; the others fill the free ranks in
arrival order, and keep them over restarts. A node that does not register within the
timeout, or whose connection drops, ends the job (``end`` with an error naming it).
A connection that fails the handshake, or sends a line that does not pass, is closed and
logged with its address; it never reaches the job, and only registered nodes hear ``stop``
and ``end`` (which carry log lines). At most :data:`MAX_PENDING` connections may be
handshaking at once (the oldest is dropped for a new one) and each has
:data:`~jfleet.launch.wire.HANDSHAKE_TIMEOUT_S` seconds. The master serves one job and
exits after ``end``.

Example:
  >>> token = b"0123456789abcdef"
  >>> server = RendezvousServer.bind(
  ...     "127.0.0.1", 0, nnodes=1, timeout_s=5, max_restart=0, token=token)
  >>> server.start()
  >>> c = RendezvousClient.connect(server.address, token=token, nnodes=1, timeout_s=5)
  >>> c.send({"type": "register", "host": "127.0.0.1", "nproc": 1, "ports": [7001], "rank": -1})
  True
  >>> c.receive(5)["nodes"]
  [{'host': '127.0.0.1', 'nproc': 1, 'ports': [7001]}]
  >>> c.send({"type": "done"}), c.receive(5)["code"]
  (True, 0)
  >>> c.close(); server.join(5)
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from jfleet.launch.schema import Node
from jfleet.launch.wire import Connection, HandshakeError, admit, join
from jfleet.runtime.log import logger
from jfleet.runtime.watchdog import ABORT_EXIT_CODE

__all__ = ["Node", "RendezvousClient", "RendezvousServer"]

#: Connections that may be handshaking at once (a new one drops the oldest).
MAX_PENDING = 32
#: Authenticated connections allowed per node of the job (a token holder's retries).
MAX_NODES_PER_SLOT = 4
#: Rejected connections logged one by one before the master only counts them.
MAX_LOGGED = 20


class RendezvousClient:
    """A launcher's authenticated connection to the master."""

    def __init__(self, sock: socket.socket, conn_args: tuple, nnodes: int) -> None:
        self._inbox: queue.Queue = queue.Queue()
        self.rejected: str | None = None
        self._conn = Connection(
            sock, *conn_args, self._inbox, None, nnodes=nnodes, on_bad=self._bad
        ).start()

    def _bad(self, tag: Any, reason: str) -> None:
        self.rejected = reason
        logger.error("jfleet.launch: a message from the rendezvous master failed: %s", reason)

    @classmethod
    def connect(
        cls,
        address: str,
        *,
        token: bytes,
        nnodes: int,
        timeout_s: float,
        stop: Callable[[], bool] = lambda: False,
    ) -> RendezvousClient:
        """Connects to ``host:port``, retrying until ``timeout_s`` (node 0 may start later),
        and checks that the master knows ``token``.

        Raises:
          TimeoutError: nothing accepted the connection in time.
          InterruptedError: ``stop()`` turned true while retrying (a signal).
          HandshakeError: the master did not prove the token, or refused this one (a
            connection that merely ends during the handshake is tried again).
        """
        host, _, port = address.rpartition(":")
        deadline = time.monotonic() + timeout_s
        while True:
            if stop():
                raise InterruptedError(f"interrupted while connecting to --master {address}")
            try:
                sock = socket.create_connection((host, int(port)), timeout=5)
            except OSError as error:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no rendezvous at --master {address} after {timeout_s:g} s ({error}); "
                        "start node 0's launcher (--rank 0) with the same --master, or check "
                        "the address and the firewall."
                    ) from None
                time.sleep(0.2)
                continue
            try:
                return cls(sock, join(sock, token, address), nnodes)
            except HandshakeError as error:  # dropped under load: again, until the deadline
                sock.close()
                if error.final or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def send(self, message: dict[str, Any]) -> bool:
        """Sends one message; False when the master is gone."""
        return self._conn.send(message)

    def receive(self, timeout_s: float | None) -> dict[str, Any] | None:
        """The next message; ``{"type": "lost"}`` when the master is gone; None on timeout."""
        try:
            _, message = self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None
        return {"type": "lost"} if message is None else message

    def close(self) -> None:
        self._conn.close()


def _consequence(first: dict[str, Any], later: dict[str, Any]) -> bool:
    """Whether ``first`` is a worker stopping because a peer failed (the watchdog's exit code)
    and ``later`` an ordinary failure: its cause, to be reported instead."""
    return first.get("exit_code") == ABORT_EXIT_CODE != later.get("exit_code") and not first.get(
        "interrupted"
    )


class RendezvousServer:
    """The master: ranks ``nnodes`` launchers, relays the first failure, decides restarts.

    Args:
      sock: a listening socket.
      nnodes: nodes to wait for.
      timeout_s: seconds to wait for every node to register (each attempt).
      max_restart: restarts of the whole job after a failure.
      token: the job token every node must prove.
      log: where rejected connections are reported (default: the ``jfleet`` logger).
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        nnodes: int,
        timeout_s: float,
        max_restart: int,
        token: bytes,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self._listener = sock
        self.nnodes = nnodes
        self.timeout_s = timeout_s
        self.max_restart = max_restart
        self._token = token
        self._log = log or logger.warning
        self._inbox: queue.Queue = queue.Queue()
        self._conns: dict[int, Connection] = {}  # authenticated
        self._peers: dict[int, str] = {}
        self._pending: OrderedDict[int, socket.socket] = OrderedDict()
        self._lock = threading.Lock()
        self.rejected = 0
        self._thread: threading.Thread | None = None

    @classmethod
    def bind(cls, host: str, port: int, **kwargs: Any) -> RendezvousServer:
        """Binds ``host:port`` (0: any port) and listens.

        Raises:
          OSError: the address is taken, or not this machine's.
        """
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((host, port))
            sock.listen(64)
        except OSError:
            sock.close()
            raise
        return cls(sock, **kwargs)

    @property
    def address(self) -> str:
        host, port = self._listener.getsockname()[:2]
        return f"{host}:{port}"

    def start(self) -> None:
        """Serves the job in a daemon thread."""
        threading.Thread(target=self._accept, daemon=True).start()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------ internals
    def _reject(self, peer: str, reason: str) -> None:
        with self._lock:
            self.rejected += 1
            n = self.rejected
        if n <= MAX_LOGGED:
            self._log(f"rendezvous: dropped a connection from {peer}: {reason}")
        if n == MAX_LOGGED:
            self._log(f"rendezvous: {n} connections dropped; further ones are not logged")

    def _accept(self) -> None:
        next_id = 0
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if len(self._pending) >= MAX_PENDING:  # drop the oldest handshake
                    _, old = self._pending.popitem(last=False)
                    with contextlib.suppress(OSError):
                        old.shutdown(socket.SHUT_RDWR)
                self._pending[next_id] = sock
            peer = f"{addr[0]}:{addr[1]}"
            threading.Thread(target=self._admit, args=(sock, next_id, peer), daemon=True).start()
            next_id += 1

    def _admit(self, sock: socket.socket, cid: int, peer: str) -> None:
        """Handshakes a new connection; files it when the node proved the token."""
        try:
            session = admit(sock, self._token)
        except (HandshakeError, OSError) as error:
            self._reject(peer, f"handshake failed ({error})")
            with self._lock:
                self._pending.pop(cid, None)
            sock.close()
            return
        with self._lock:
            full = len(self._conns) >= MAX_NODES_PER_SLOT * self.nnodes
            if self._pending.pop(cid, None) is None or full:  # dropped meanwhile, or too many
                sock.close()
                return
            conn = Connection(
                sock, *session, self._inbox, cid, nnodes=self.nnodes, on_bad=self._bad_line
            )
            self._conns[cid] = conn
            self._peers[cid] = peer
        conn.start()

    def _bad_line(self, cid: int, reason: str) -> None:
        self._reject(self._peers.get(cid, "?"), f"an authenticated line failed: {reason}")

    def _broadcast(self, message: dict[str, Any]) -> None:
        for conn in list(self._conns.values()):
            conn.send(message)

    def _end(self, code: int, failure: Any = None, error: str | None = None) -> None:
        self._broadcast({"type": "end", "code": code, "failure": failure, "error": error})
        with contextlib.suppress(OSError):
            self._listener.close()

    def _serve(self) -> None:
        try:
            self._run()
        except Exception as error:  # never leave the launchers waiting
            logger.exception("jfleet.launch: the rendezvous master failed")
            self._end(1, error=f"the rendezvous master failed: {error!r}")

    def _register(self, ranks: dict[int, int], attempt: int) -> dict[int, Node] | str:
        """Waits for every node's ``register``; returns conn id -> Node, or an error."""
        nodes: dict[int, Node] = {}
        wanted: dict[int, int] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(nodes) < self.nnodes:
            try:
                cid, msg = self._inbox.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                missing = self.nnodes - len(nodes)
                return (
                    f"{len(nodes)} of {self.nnodes} nodes registered with the rendezvous within "
                    f"{self.timeout_s:g} s (attempt {attempt}); {missing} node(s) never showed: "
                    "start a launcher on every node with the same --master and --nnodes, or "
                    "raise JFLEET_INIT_TIMEOUT."
                )
            if msg is None:
                if cid in nodes or cid in ranks:
                    return f"node {ranks.get(cid, '?')}'s launcher disconnected while registering."
                continue
            if msg["type"] != "register" or cid in nodes:
                continue
            nodes[cid] = Node.from_json(msg)
            wanted[cid] = msg["rank"]
        endpoints = [(n.host, p) for n in nodes.values() for p in n.ports]
        if len(set(endpoints)) != len(endpoints):
            return (
                "two nodes registered the same host and port; give each node its own --host "
                f"(registered: {sorted(f'{n.host}:{list(n.ports)}' for n in nodes.values())})."
            )
        if not ranks:  # first attempt: given ranks, then arrival order
            taken: dict[int, int] = {}
            for cid, r in wanted.items():
                if r >= 0:
                    if r in taken:
                        return f"two launchers were given --rank {r}; give each node its own rank."
                    taken[r] = cid
            free = iter(r for r in range(self.nnodes) if r not in taken)
            for cid, r in wanted.items():
                ranks[cid] = r if r >= 0 else next(free)
        elif set(ranks) != set(nodes):
            return "a node's launcher reconnected after a restart; node ranks changed."
        return nodes

    def _run(self) -> None:
        ranks: dict[int, int] = {}
        attempt = 0
        while True:
            nodes = self._register(ranks, attempt)
            if isinstance(nodes, str):
                self._end(1, error=nodes)
                return
            ordered = sorted(nodes, key=lambda cid: ranks[cid])
            listing = [nodes[cid].to_json() for cid in ordered]
            for cid in ordered:
                self._conns[cid].send(
                    {"type": "start", "attempt": attempt, "node_rank": ranks[cid], "nodes": listing}
                )
            verdict = self._watch(ranks)
            if verdict is None:
                self._end(0)
                return
            failure, lost = verdict
            if lost or failure.get("interrupted") or attempt >= self.max_restart:
                self._end(int(failure.get("exit_code", 1)), failure=failure)
                return
            attempt += 1
            self._broadcast({"type": "restart", "attempt": attempt})

    def _watch(self, ranks: dict[int, int]) -> tuple[dict[str, Any], bool] | None:
        """Runs one attempt; None when every node is done, else (first failure, node lost)."""
        done: set[int] = set()
        stopped: set[int] = set()
        failure: dict[str, Any] | None = None
        lost = False
        while True:
            cid, msg = self._inbox.get()
            if cid not in ranks:
                continue
            if msg is None:
                lost = True
                stopped.add(cid)
                if failure is None:
                    failure = {
                        "what": f"node {ranks[cid]}'s launcher disconnected",
                        "exit_code": 1,
                    }
                    self._broadcast({"type": "stop", "failure": failure})
            elif msg["type"] == "done":
                done.add(cid)
            elif msg["type"] == "failed" and failure is None:
                failure = msg["failure"]
                self._broadcast({"type": "stop", "failure": failure})
            elif msg["type"] == "failed" and _consequence(failure, msg["failure"]):
                failure = msg["failure"]  # the cause, reported just after its consequence
            elif msg["type"] == "stopped":
                stopped.add(cid)
            if failure is None and len(done) == len(ranks):
                return None
            if failure is not None and len(stopped) == len(ranks):
                return failure, lost
