"""The rendezvous against hostile clients: strangers, wrong tokens, junk, floods, fake masters.

Everything runs on 127.0.0.1 with bounded counts and timeouts. The in-process tests talk to a
:class:`RendezvousServer` with raw sockets; the last ones run real launchers (subprocesses):
a 2-node job that finishes with exit 0 and the right result while strangers hammer its
master, and a launcher that refuses a fake master before starting any worker.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import re
import socket
import textwrap
import threading
import time

import pytest

from jfleet.launch import launch, wire
from jfleet.launch.auth import Channel, mac, new_nonce
from jfleet.launch.rendezvous import MAX_PENDING, RendezvousClient, RendezvousServer
from jfleet.launch.wire import HandshakeError
from tests.subprocess_util import free_port
from tests.test_launch import finish, start

TOKEN = b"test-token-0123456789"
REGISTER = {"type": "register", "host": "127.0.0.1", "nproc": 1, "ports": [7001], "rank": -1}


@pytest.fixture
def server(monkeypatch):
    """A 1-node master with a 1 s handshake window; its log lines in ``server.lines``."""
    monkeypatch.setattr(wire, "HANDSHAKE_TIMEOUT_S", 1.0)
    lines: list[str] = []
    s = RendezvousServer.bind(
        "127.0.0.1", 0, nnodes=1, timeout_s=20, max_restart=0, token=TOKEN, log=lines.append
    )
    s.lines = lines
    s.start()
    yield s
    s.join(1)


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _read_until_closed(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything the master sends until it closes the connection (AssertionError if it
    keeps it open past ``timeout``)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"the master kept a hostile connection open: {data[:200]!r}") from None
    return data


def _logged(server: RendezvousServer, matches, timeout_s: float = 5.0) -> bool:
    """Whether the master logs a line ``matches`` within ``timeout_s``. The master logs a
    refusal on its own handshake thread, which can run after the refused client has returned."""
    deadline = time.monotonic() + timeout_s
    while not any(matches(line) for line in server.lines):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _legit_job_ends_0(server: RendezvousServer) -> None:
    c = RendezvousClient.connect(server.address, token=TOKEN, nnodes=1, timeout_s=5)
    assert c.send(REGISTER)
    assert c.receive(5)["type"] == "start"
    c.send({"type": "done"})
    end = c.receive(5)
    assert (end["type"], end["code"]) == ("end", 0), end
    c.close()


def _hostile_lines() -> list[bytes]:
    big = b"x" * (wire.MAX_LINE + 10)  # no newline: must not grow without bound
    return [
        json.dumps(REGISTER).encode() + b"\n",  # the one-line hijack of issue 28
        b'{"type": "register"}\n',  # the one-line kill
        b"[1]\n",
        b"{not json\n",
        b'{"type": "auth", "nonce": "00", "mac": "00"}\n',
        big,
    ]


@pytest.mark.parametrize("payload", _hostile_lines(), ids=range(6))
def test_an_unauthenticated_line_is_dropped_logged_and_the_job_goes_on(server, payload):
    with socket.create_connection(_host_port(server.address), timeout=5) as s:
        s.sendall(payload)
        got = _read_until_closed(s)
    assert got.count(b"\n") == 1 and b'"hello"' in got, got  # nothing after the challenge
    _legit_job_ends_0(server)
    assert _logged(
        server,
        lambda line: re.match(
            r"rendezvous: dropped a connection from 127\.0\.0\.1:\d+: handshake", line
        ),
    ), server.lines


def test_a_wrong_token_is_refused_both_ways(server):
    with pytest.raises(HandshakeError, match="not this job's rendezvous"):
        RendezvousClient.connect(server.address, token=b"another-token-0123", nnodes=1, timeout_s=5)
    assert _logged(server, lambda line: "a wrong job token" in line), server.lines
    _legit_job_ends_0(server)


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("host", "127.0.0.1:1,10.6.6.6", "is not a hostname or an IP address"),
        ("host", ["127.0.0.1"], "is not a hostname"),
        ("ports", [70000], "distinct ports in 1..65535"),
        ("ports", [7001, 7001], "distinct ports"),
        ("nproc", "1", "nproc='1' is not an integer"),
        ("rank", 5, "rank=5 is not an integer in -1..0"),
    ],
)
def test_a_token_holders_malformed_register_is_dropped_and_named(server, field, value, reason):
    sock = socket.create_connection(_host_port(server.address), timeout=5)
    channel, _ = wire.join(sock, TOKEN, server.address)
    sock.sendall((channel.seal({**REGISTER, field: value}) + "\n").encode())
    _read_until_closed(sock)
    sock.close()
    assert _logged(server, lambda line: reason in line and "127.0.0.1:" in line), server.lines
    _legit_job_ends_0(server)


def _unsigned(channel: Channel) -> list[str]:
    return [json.dumps(REGISTER)]  # the one-line hijack, after a genuine handshake


def _signed_then_stripped(channel: Channel) -> list[str]:
    frame = json.loads(channel.seal(REGISTER))
    return [json.dumps({"seq": frame["seq"], "body": frame["body"]})]


def _wrong_key(channel: Channel) -> list[str]:
    stranger = Channel.session(b"another-token-0123", "a" * 32, "b" * 32, "node")
    return [stranger.seal(REGISTER)]


def _replayed(channel: Channel) -> list[str]:
    line = channel.seal({"type": "done"})  # accepted (and ignored while registering) once
    return [line, line]


def _altered(channel: Channel) -> list[str]:
    frame = json.loads(channel.seal(REGISTER))
    frame["body"] = frame["body"].replace('"nproc": 1', '"nproc": 8')
    assert '"nproc": 8' in frame["body"]
    return [json.dumps(frame)]


@pytest.mark.parametrize(
    ("forge", "reason"),
    [
        (_unsigned, "not a signed line"),
        (_signed_then_stripped, "not a signed line"),
        (_wrong_key, "bad MAC"),
        (_replayed, "sequence 1 after 1 (replayed or reordered)"),
        (_altered, "bad MAC"),
    ],
    ids=["unsigned", "mac-stripped", "wrong-key", "replayed", "altered-body"],
)
def test_a_forged_line_after_the_handshake_is_refused_logged_and_the_job_goes_on(
    server, forge, reason
):
    """SECURITY.md: after the handshake, "a line from outside the connection, replayed,
    reordered or altered fails its check" (issue 40: nothing sent one before)."""
    sock = socket.create_connection(_host_port(server.address), timeout=5)
    channel, _ = wire.join(sock, TOKEN, server.address)
    for line in forge(channel):
        sock.sendall((line + "\n").encode())
    heard = _read_until_closed(sock)  # the master hangs up on the forger
    sock.close()
    assert heard == b"", heard  # and says nothing to it
    expected = f"an authenticated line failed: {reason}"
    assert _logged(server, lambda line: expected in line and "127.0.0.1:" in line), (
        f"the master did not log {expected!r}; it logged {server.lines}"
    )
    _legit_job_ends_0(server)


def test_500_idle_connections_hold_bounded_threads_and_the_job_goes_on(server):
    before = threading.active_count()
    idle = []
    try:
        for _ in range(500):
            idle.append(socket.create_connection(_host_port(server.address), timeout=5))
        time.sleep(0.5)
        assert threading.active_count() - before <= MAX_PENDING + 2
        _legit_job_ends_0(server)
    finally:
        for s in idle:
            s.close()
    assert len(server.lines) <= 21, server.lines[-3:]  # 20 logged, then one summary line


def test_a_stranger_hears_no_log_line(server):
    stranger = socket.create_connection(_host_port(server.address), timeout=5)
    c = RendezvousClient.connect(server.address, token=TOKEN, nnodes=1, timeout_s=5)
    c.send(REGISTER)
    assert c.receive(5)["type"] == "start"
    failure = {"what": "rank 0 failed", "exit_code": 3, "tail": ["SECRET=hunter2"]}
    c.send({"type": "failed", "failure": failure})
    assert c.receive(5)["failure"]["tail"] == ["SECRET=hunter2"]  # the node hears it
    c.send({"type": "stopped"})
    assert c.receive(5)["code"] == 3
    c.close()
    heard = _read_until_closed(stranger)
    stranger.close()
    assert b"SECRET" not in heard and b"stop" not in heard and b"end" not in heard, heard


def test_a_signed_line_replayed_or_from_another_connection_fails():
    node = Channel.session(TOKEN, "a" * 32, "b" * 32, "node")
    master = Channel.session(TOKEN, "a" * 32, "b" * 32, "master")
    other = Channel.session(TOKEN, "a" * 32, "c" * 32, "master")
    line = node.seal({"type": "done"})
    assert master.open(line) == {"type": "done"}
    with pytest.raises(ValueError, match="replayed or reordered"):
        master.open(line)
    with pytest.raises(ValueError, match="bad MAC"):
        other.open(line)
    reflected = Channel.session(TOKEN, "a" * 32, "b" * 32, "node")
    with pytest.raises(ValueError, match="bad MAC"):  # a node's line sent back to a node
        reflected.open(node.seal({"type": "done"}))


def _fake_master(sock: socket.socket, welcome: dict) -> None:
    """Accepts one launcher, plays the handshake without the token, then says ``end 0``."""
    conn, _ = sock.accept()
    with conn:
        conn.sendall((json.dumps({"type": "hello", "nonce": new_nonce()}) + "\n").encode())
        conn.recv(65536)
        conn.sendall((json.dumps(welcome) + "\n").encode())
        conn.sendall(b'{"type": "end", "code": 0}\n')
        time.sleep(1)


def test_a_fake_master_is_refused_before_any_worker_starts(tmp_path):
    script = tmp_path / "never.py"
    script.write_text("open(__file__ + '.ran', 'w')\n")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    port = sock.getsockname()[1]
    welcome = {"type": "welcome", "mac": mac(b"guessed-token-00000", "master", "x", "y")}
    threading.Thread(target=_fake_master, args=(sock, welcome), daemon=True).start()
    flags = ["--nnodes", "2", "--master", f"127.0.0.1:{port}", "--log_dir", str(tmp_path / "log")]
    launcher = start([*flags, str(script)])
    ((rc, _, err),) = finish([launcher], timeout=60)
    sock.close()
    assert rc == 1, err
    assert "the master did not prove the job token" in err, err
    assert "every worker exited 0" not in err, err
    assert not (tmp_path / "never.py.ran").exists() and not (tmp_path / "log").exists()


def test_a_multi_node_job_without_a_token_is_a_settings_error(tmp_path, capsys, monkeypatch):
    script = tmp_path / "t.py"
    script.write_text("")
    monkeypatch.delenv("JFLEET_JOB_TOKEN", raising=False)
    monkeypatch.delenv("JFLEET_JOB_TOKEN_FILE", raising=False)
    args = ["--nnodes", "2", "--master", "127.0.0.1:1", str(script)]
    assert launch(args) == 2
    assert "a 2-node job needs a job token" in capsys.readouterr().err
    monkeypatch.setenv("JFLEET_JOB_TOKEN", "short")
    assert launch(args) == 2
    assert "JFLEET_JOB_TOKEN: the job token has 5 characters" in capsys.readouterr().err
    monkeypatch.delenv("JFLEET_JOB_TOKEN")
    monkeypatch.setenv("JFLEET_JOB_TOKEN_FILE", str(tmp_path / "missing"))
    assert launch(args) == 2
    assert "JFLEET_JOB_TOKEN_FILE=" in capsys.readouterr().err
    monkeypatch.delenv("JFLEET_JOB_TOKEN_FILE")
    monkeypatch.setenv("JFLEET_INIT_TIMEOUT", "abc")
    assert launch([str(script)]) == 2
    assert "JFLEET_INIT_TIMEOUT='abc' is not a positive whole number" in capsys.readouterr().err


# ----------------------------------------------------- a real job under attack (subprocesses)

JOB = """
import os, psutil
from jax.experimental import multihost_utils
import numpy as np
from jfleet.runtime.role_maker import PaddleCloudRoleMaker
from jfleet.runtime.startup import initialize_distributed
initialize_distributed(PaddleCloudRoleMaker(is_collective=True))
import jax
if jax.process_index() == 0:
    port = int(os.environ["PADDLE_MASTER"].rsplit(":", 1)[1])
    for c in psutil.Process().net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port:
            print("LISTEN", c.laddr.ip, flush=True)
rank = jax.process_index()
total = multihost_utils.process_allgather(np.array([rank + 1.0])).sum()
print("TOTAL", total, flush=True)
"""


def _attack(address: str, stop: threading.Event) -> list[bytes]:
    """Hostile lines and 500 idle connections against the master until ``stop``."""
    host, port = _host_port(address)
    heard, idle = [], []
    deadline = time.monotonic() + 60
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            for payload in _hostile_lines():
                with socket.create_connection((host, port), timeout=5) as s:
                    s.sendall(payload)
                    heard.append(_read_until_closed(s))
            while len(idle) < 500:
                idle.append(socket.create_connection((host, port), timeout=5))
            break
        except OSError:
            time.sleep(0.2)  # the master is not up yet
    stop.wait(120)
    for s in idle:
        s.close()
    return heard


def test_a_two_node_job_finishes_under_attack_and_the_coordinator_binds_the_master(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    master = f"127.0.0.1:{free_port()}"
    common = ["--nnodes", "2", "--master", master]
    node0 = start([*common, "--rank", "0", "--log_dir", str(tmp_path / "n0"), str(script)])
    stop, heard = threading.Event(), []
    attacker = threading.Thread(target=lambda: heard.extend(_attack(master, stop)))
    attacker.start()
    time.sleep(3)
    wrong = start(
        [*common, "--log_dir", str(tmp_path / "wrong"), str(script)],
        env={"JFLEET_JOB_TOKEN": "a-wrong-token-0123456789"},
    )
    node1 = start([*common, "--rank", "1", "--log_dir", str(tmp_path / "n1"), str(script)])
    try:
        results = finish([node0, node1, wrong], timeout=240)
    finally:
        stop.set()
        attacker.join(10)
    (rc0, out0, err0), (rc1, out1, err1), (rcw, _, errw) = results
    assert rc0 == 0 and rc1 == 0, f"{err0[-3000:]}\n---\n{err1[-3000:]}"
    assert "[rank 0] TOTAL 3.0" in out0 and "[rank 1] TOTAL 3.0" in out1, (out0, out1)
    listening = [ipaddress.ip_address(ip) for ip in re.findall(r"LISTEN (\S+)", out0)]
    bound = [getattr(ip, "ipv4_mapped", None) or ip for ip in listening]  # gRPC: ::ffff:a.b.c.d
    assert bound == [ipaddress.ip_address("127.0.0.1")], out0  # not every interface (::)
    assert rcw == 1 and "not this job's rendezvous" in errw, errw
    assert not (tmp_path / "wrong").exists()  # the wrong-token launcher started nothing
    assert "dropped a connection from 127.0.0.1:" in err0, err0
    assert heard and all(h.count(b"\n") <= 1 for h in heard), heard  # a hello, nothing else


def test_the_coordinator_binds_its_own_address_unless_told_otherwise(monkeypatch):
    from jfleet.runtime.coordination import bind_address

    monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
    assert bind_address("127.0.0.1:6170") == "127.0.0.1:6170"
    assert bind_address("localhost:6170") in ("127.0.0.1:6170", "[::1]:6170")
    assert bind_address("no-such-host.invalid:6170") is None  # JAX's error names it
    monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", "10.0.0.1:6170")
    assert bind_address("127.0.0.1:6170") is None  # JAX reads the variable


def _pipe(a: socket.socket, b: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := a.recv(65536):
            b.sendall(data)
    with contextlib.suppress(OSError):
        b.shutdown(socket.SHUT_WR)


def _drops_the_first_then_relays(front: socket.socket, server: RendezvousServer) -> None:
    """The first connection is cut after the hello (as under a flood); later ones are relayed."""
    first, _ = front.accept()
    first.sendall((json.dumps({"type": "hello", "nonce": new_nonce()}) + "\n").encode())
    first.close()
    conn, _ = front.accept()
    upstream = socket.create_connection(_host_port(server.address), timeout=5)
    upstream.settimeout(None)
    conn.settimeout(None)
    threading.Thread(target=_pipe, args=(conn, upstream), daemon=True).start()
    threading.Thread(target=_pipe, args=(upstream, conn), daemon=True).start()


def test_a_handshake_cut_short_is_tried_again(server):
    front = socket.socket()
    front.bind(("127.0.0.1", 0))
    front.listen(4)
    relay = threading.Thread(target=_drops_the_first_then_relays, args=(front, server))
    relay.start()
    address = f"127.0.0.1:{front.getsockname()[1]}"
    c = RendezvousClient.connect(address, token=TOKEN, nnodes=1, timeout_s=10)
    assert c.send(REGISTER) and c.receive(5)["type"] == "start"
    c.send({"type": "done"})
    assert c.receive(5)["code"] == 0
    c.close()
    relay.join(5)
    front.close()
