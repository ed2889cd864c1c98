"""Starting a multi-process job: ``jax.distributed`` bring-up for what a role maker says.

:func:`initialize_distributed` joins this process to the job (coordinator address,
process count and rank from a :mod:`~jfleet.runtime.role_maker` role maker), with
jfleet's timeouts (``JFLEET_INIT_TIMEOUT``, ``JFLEET_HEARTBEAT_TIMEOUT``,
``JFLEET_SHUTDOWN_TIMEOUT``), a clear exit naming the missing ranks when peers do not
connect, the coordinator bound to the master address only, and the job watchdog started.

Example:
  >>> from jfleet.runtime.role_maker import PaddleCloudRoleMaker
  >>> initialize_distributed(PaddleCloudRoleMaker())  # one process: nothing to do
  False
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from typing import Any

from jfleet.runtime import coordination as _coordination
from jfleet.runtime import watchdog
from jfleet.runtime.env import seconds
from jfleet.runtime.log import logger

DEFAULT_INIT_TIMEOUT_S = 300


DEFAULT_HEARTBEAT_TIMEOUT_S = 100


DEFAULT_SHUTDOWN_TIMEOUT_S = 60


INIT_TIMEOUT_ENV = "JFLEET_INIT_TIMEOUT"


HEARTBEAT_TIMEOUT_ENV = "JFLEET_HEARTBEAT_TIMEOUT"


SHUTDOWN_TIMEOUT_ENV = "JFLEET_SHUTDOWN_TIMEOUT"


#: Exit code of a process whose peers did not all connect within the init timeout.
NOT_CONNECTED_EXIT_CODE = 1


# JAX's own connect deadline comes this much after jfleet's, which names the missing ranks.
_JAX_DEADLINE_GRACE_S = 5


def _timeout(value: int | None, env_name: str, default: int, arg_name: str) -> int:
    if value is None:
        return int(seconds(env_name, default, whole=True))
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{arg_name}={value!r} must be a positive number of seconds.")
    return value


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge

        return xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # pragma: no cover - private API moved
        return False


_TOO_LATE = (
    "call fleet.init before any JAX computation: the JAX backend of this process has "
    "already started (something called jax.devices(), created an array or ran a "
    "computation), so it can no longer join a {n}-process job. Move fleet.init (or "
    "jfleet.role_maker.initialize_distributed) to the top of the script."
)


def _coordinator_listening(address: str, timeout: float = 1.0) -> bool:
    """Whether something accepts TCP connections at ``host:port``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def not_connected_message(
    *, rank: int, num: int, coordinator: str, timeout: int, coordinator_up: bool | None
) -> str:
    """What a process says when not every process connected within the init timeout.

    ``coordinator_up``: on ranks other than 0, whether the coordinator's port answers.

    Example:
      >>> print(not_connected_message(rank=0, num=2, coordinator="10.0.0.1:6170",
      ...                             timeout=10, coordinator_up=None))  # doctest: +ELLIPSIS
      jfleet: rank 1 did not connect ... within 10 s (JFLEET_INIT_TIMEOUT); this is rank 0 of 2...
    """
    if rank == 0:
        who = "rank 1" if num == 2 else f"at least one of ranks 1..{num - 1}"
        where = f"to the coordinator this process hosts at {coordinator}"
    elif coordinator_up is False:
        who = "rank 0"
        where = (
            f"(nothing answers at the coordinator address {coordinator}: rank 0, which hosts "
            "the coordinator, has not started or died, or the address is wrong)"
        )
    else:
        who = f"at least one rank other than {rank}"
        where = f"to the coordinator at {coordinator} (its port answers: another job's?)"
    return (
        f"jfleet: {who} did not connect {where} within {timeout} s ({INIT_TIMEOUT_ENV}); "
        f"this is rank {rank} of {num} expected processes, exiting with code "
        f"{NOT_CONNECTED_EXIT_CODE}. Start all {num} processes (ranks 0..{num - 1}) with the "
        "same coordinator address and process count; check the address, the ports and the "
        f"firewall between hosts; raise {INIT_TIMEOUT_ENV} if some processes start late."
    )


def _connect(connect: Any, *, rank: int, num: int, coordinator: str, timeout: int) -> None:
    """Runs ``connect()`` (JAX's, which aborts the process on its own deadline with a
    message naming no rank); after ``timeout`` seconds, says who is missing and exits."""
    done = threading.Event()

    def give_up() -> None:
        if done.is_set():
            return
        up = None if rank == 0 else _coordinator_listening(coordinator)
        message = not_connected_message(
            rank=rank, num=num, coordinator=coordinator, timeout=timeout, coordinator_up=up
        )
        if done.is_set():
            return
        sys.stdout.flush()
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        os._exit(NOT_CONNECTED_EXIT_CODE)

    timer = threading.Timer(timeout, give_up)
    timer.daemon = True
    timer.start()
    try:
        connect()
    finally:
        done.set()
        timer.cancel()


def initialize_distributed(
    role_maker: Any,
    *,
    initialization_timeout: int | None = None,
    heartbeat_timeout_seconds: int | None = None,
    shutdown_timeout_seconds: int | None = None,
) -> bool:
    """Joins this process to the multi-process JAX job that ``role_maker`` describes.

    With one process this does nothing. Otherwise it calls ``jax.distributed.initialize``
    with the role maker's coordinator address, process count and rank, unless JAX is
    already initialised, in which case it checks that JAX agrees with the role maker.
    Then it starts :mod:`jfleet.watchdog`.

    If not every process connects within the init timeout, the process prints which
    ranks are missing (on ranks other than 0: whether the coordinator's port answers),
    the address and the fix, and exits with code 1 (``NOT_CONNECTED_EXIT_CODE``), before
    JAX's own abort ("DEADLINE_EXCEEDED ... another task died", naming no rank). It cannot
    raise: the main thread is blocked inside JAX's connect.

    Args:
      role_maker: the job layout.
      initialization_timeout: seconds to wait for every process to connect; default
        ``$JFLEET_INIT_TIMEOUT`` or 300.
      heartbeat_timeout_seconds: seconds without a heartbeat before a peer counts as
        dead and the job aborts; default ``$JFLEET_HEARTBEAT_TIMEOUT`` or 100.
      shutdown_timeout_seconds: at exit, seconds the processes wait for each other in
        JAX's shutdown barrier before giving up; default ``$JFLEET_SHUTDOWN_TIMEOUT`` or
        60 (JAX's own default is 300).

    Returns:
      True if this call initialised ``jax.distributed``; False if there was nothing to do
      (one process, or JAX was already initialised consistently).

    Raises:
      ValueError: JAX is already initialised with another process count or rank; or a
        timeout is not a positive integer.
      RuntimeError: the JAX backend already started in this process, so it can no longer
        join a multi-process job ("call fleet.init before any JAX computation").

    Example:
      >>> from jfleet.runtime.role_maker import PaddleCloudRoleMaker
      >>> initialize_distributed(PaddleCloudRoleMaker())  # one process: nothing to do
      False
    """
    import jax

    num, index = role_maker.worker_num(), role_maker.worker_index()
    if jax.distributed.is_initialized():
        _check_already_initialized(num, index)
        if num > 1:
            watchdog.start()
        return False
    if num == 1:
        return False
    init_timeout, heartbeat, shutdown = _timeouts(
        initialization_timeout, heartbeat_timeout_seconds, shutdown_timeout_seconds
    )
    if _backend_started():
        raise RuntimeError(_TOO_LATE.format(n=num))
    coordinator = str(role_maker.coordinator_address())
    logger.info(
        "Initialising jax.distributed: process %d of %d, coordinator %s.", index, num, coordinator
    )

    def connect() -> None:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num,
            process_id=index,
            initialization_timeout=init_timeout + _JAX_DEADLINE_GRACE_S,
            heartbeat_timeout_seconds=heartbeat,
            shutdown_timeout_seconds=shutdown,
            coordinator_bind_address=_coordination.bind_address(coordinator),
        )

    try:
        _connect(connect, rank=index, num=num, coordinator=coordinator, timeout=init_timeout)
    except RuntimeError as e:
        if "must be called before" in str(e):
            raise RuntimeError(_TOO_LATE.format(n=num)) from e
        raise
    watchdog.start(heartbeat_timeout_s=heartbeat)
    return True


def _check_already_initialized(num: int, index: int) -> None:
    """JAX was initialised before (by the user): it must agree with the role maker."""
    import jax

    if jax.process_count() != num or jax.process_index() != index:
        raise ValueError(
            f"jax.distributed is already initialised as process {jax.process_index()} of "
            f"{jax.process_count()}, but the role maker says process {index} of {num}; "
            "make the role maker's settings match, or let fleet.init initialise JAX."
        )
    logger.debug("jax.distributed already initialised as process %d of %d.", index, num)


def _timeouts(init: int | None, heartbeat: int | None, shutdown: int | None) -> tuple[int, ...]:
    """The three timeouts: the arguments, else the environment, else the defaults."""
    return (
        _timeout(init, INIT_TIMEOUT_ENV, DEFAULT_INIT_TIMEOUT_S, "initialization_timeout"),
        _timeout(
            heartbeat,
            HEARTBEAT_TIMEOUT_ENV,
            DEFAULT_HEARTBEAT_TIMEOUT_S,
            "heartbeat_timeout_seconds",
        ),
        _timeout(
            shutdown, SHUTDOWN_TIMEOUT_ENV, DEFAULT_SHUTDOWN_TIMEOUT_S, "shutdown_timeout_seconds"
        ),
    )
