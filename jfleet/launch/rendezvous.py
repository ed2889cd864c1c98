"""The nodes' rendezvous: a tiny TCP service on node 0 that ranks nodes and ends the job.

Every launcher (node 0's included) connects to ``--master`` and speaks JSON lines:

  node -> master   ``register {host, nproc, ports, rank}``   (once per attempt)
  master -> node   ``start {attempt, node_rank, nodes}``       when all ``nnodes`` registered
  node -> master   ``done`` (its workers all exited 0) | ``failed {failure}`` | ``stopped``
  master -> node   ``stop {failure}`` (reap your workers) after the first failure,
                   then ``restart {attempt}`` (register again) or
                   ``end {code, failure, error}`` (exit with ``code``)

Node ranks: a launcher given ``--rank`` gets it; the others fill the free ranks in
arrival order, and keep them over restarts. A node that does not register within the
timeout, or whose connection drops, ends the job (``end`` with an error naming it).
The master serves one job and exits after ``end``.

Example:
  >>> server = RendezvousServer.bind("127.0.0.1", 0, nnodes=1, timeout_s=5, max_restart=0)
  >>> server.start()
  >>> c = RendezvousClient.connect(server.address, timeout_s=5)
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
import dataclasses
import json
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from jfleet.runtime.log import logger

__all__ = ["Node", "RendezvousClient", "RendezvousServer"]


@dataclasses.dataclass(frozen=True)
class Node:
    """A node as the job sees it: the host others reach it at, its workers, their ports."""

    host: str
    nproc: int
    ports: tuple[int, ...]

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Node:
        return cls(str(d["host"]), int(d["nproc"]), tuple(int(p) for p in d["ports"]))


class _Connection:
    """A socket speaking JSON lines; a reader thread puts messages (None at EOF) on a queue."""

    def __init__(self, sock: socket.socket, inbox: queue.Queue, tag: Any) -> None:
        self.sock = sock
        self._lock = threading.Lock()
        self._closed = False
        self._reader = threading.Thread(target=self._read, args=(inbox, tag), daemon=True)

    def start(self) -> _Connection:
        """Starts reading (after the owner has filed the connection)."""
        self._reader.start()
        return self

    def _read(self, inbox: queue.Queue, tag: Any) -> None:
        buffer = b""
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    break
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        inbox.put((tag, json.loads(line)))
        except (OSError, ValueError):
            pass
        inbox.put((tag, None))

    def send(self, message: dict[str, Any]) -> bool:
        """Sends one message; False when the peer is gone."""
        data = (json.dumps(message) + "\n").encode()
        with self._lock:
            if self._closed:
                return False
            try:
                self.sock.sendall(data)
            except OSError:
                return False
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class RendezvousClient:
    """A launcher's connection to the master."""

    def __init__(self, sock: socket.socket) -> None:
        self._inbox: queue.Queue = queue.Queue()
        self._conn = _Connection(sock, self._inbox, None).start()

    @classmethod
    def connect(
        cls, address: str, *, timeout_s: float, stop: Callable[[], bool] = lambda: False
    ) -> RendezvousClient:
        """Connects to ``host:port``, retrying until ``timeout_s`` (node 0 may start later).

        Raises:
          TimeoutError: nothing accepted the connection in time.
          InterruptedError: ``stop()`` turned true while retrying (a signal).
        """
        host, _, port = address.rpartition(":")
        deadline = time.monotonic() + timeout_s
        while True:
            if stop():
                raise InterruptedError(f"interrupted while connecting to --master {address}")
            try:
                sock = socket.create_connection((host, int(port)), timeout=5)
                sock.settimeout(None)
                return cls(sock)
            except OSError as error:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no rendezvous at --master {address} after {timeout_s:g} s ({error}); "
                        "start node 0's launcher (--rank 0) with the same --master, or check "
                        "the address and the firewall."
                    ) from None
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


class RendezvousServer:
    """The master: ranks ``nnodes`` launchers, relays the first failure, decides restarts.

    Args:
      sock: a listening socket.
      nnodes: nodes to wait for.
      timeout_s: seconds to wait for every node to register (each attempt).
      max_restart: restarts of the whole job after a failure.
    """

    def __init__(
        self, sock: socket.socket, *, nnodes: int, timeout_s: float, max_restart: int
    ) -> None:
        self._listener = sock
        self.nnodes = nnodes
        self.timeout_s = timeout_s
        self.max_restart = max_restart
        self._inbox: queue.Queue = queue.Queue()
        self._conns: dict[int, _Connection] = {}
        self._thread: threading.Thread | None = None

    @classmethod
    def bind(
        cls, host: str, port: int, *, nnodes: int, timeout_s: float, max_restart: int
    ) -> RendezvousServer:
        """Binds ``host:port`` (0: any port) and listens.

        Raises:
          OSError: the address is taken, or not this machine's.
        """
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((host, port))
            sock.listen(max(nnodes, 16))
        except OSError:
            sock.close()
            raise
        return cls(sock, nnodes=nnodes, timeout_s=timeout_s, max_restart=max_restart)

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
    def _accept(self) -> None:
        next_id = 0
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            conn = self._conns[next_id] = _Connection(sock, self._inbox, next_id)
            conn.start()
            next_id += 1

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
            if msg.get("type") != "register":
                continue
            nodes[cid] = Node.from_json(msg)
            wanted[cid] = int(msg.get("rank", -1))
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
            listing = [dataclasses.asdict(nodes[cid]) for cid in ordered]
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
            elif msg["type"] == "stopped":
                stopped.add(cid)
            if failure is None and len(done) == len(ranks):
                return None
            if failure is not None and len(stopped) == len(ranks):
                return failure, lost
