"""Role makers: who this process is in the job.

A role maker answers Paddle's questions about the job (``worker_index``,
``worker_num``, ``node_num``, ``local_rank``, endpoints) from the environment
(:class:`PaddleCloudRoleMaker`) or from arguments (:class:`UserDefinedRoleMaker`).
:func:`jfleet.runtime.startup.initialize_distributed` turns the answer into one
``jax.distributed`` job, after which ``jax.devices()`` lists the devices of every process.

Unlike Paddle, a half-configured environment is an error, never a silent fall-back
to one process: a job whose ranks each think they are alone trains ``worker_num``
unrelated models.

``is_collective=False`` builds :class:`jfleet.ps.role_maker.PSRoleMaker` (parameter servers).

Example:
  >>> from jfleet.runtime.role_maker import UserDefinedRoleMaker
  >>> rm = UserDefinedRoleMaker(current_id=1, worker_endpoints=["10.0.0.1:6170", "10.0.0.1:6171"])
  >>> rm.worker_index(), rm.worker_num(), rm.local_rank(), rm.node_num()
  (1, 2, 1, 1)
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping, Sequence
from typing import Any

from jfleet.runtime.log import logger

# ``jfleet.role_maker.initialize_distributed``: the path the docs and examples name.
from jfleet.runtime.startup import initialize_distributed as initialize_distributed

__all__ = [
    "PaddleCloudRoleMaker",
    "Role",
    "RoleMakerBase",
    "UserDefinedRoleMaker",
]


_PS_MESSAGE = (
    "parameter-server mode (is_collective=False) is built by jfleet.ps.role_maker, which "
    "`import jfleet` loads; import jfleet first, or use fleet.init(is_collective=True) or a "
    "role maker with is_collective=True."
)


_PS_ROLE_MAKERS: dict[type, Any] = {}  # is_collective=False builders: jfleet.ps.role_maker


class Role(enum.IntEnum):
    """The role of a process, with Paddle's values.

    Example:
      >>> int(Role.WORKER), Role(2).name
      (1, 'SERVER')
    """

    WORKER = 1
    SERVER = 2
    HETER_WORKER = 3
    ALL = 4
    COORDINATOR = 5


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A validated description of the job, as seen by one process."""

    worker_index: int
    worker_num: int
    worker_endpoints: tuple[str, ...]
    current_endpoint: str
    coordinator_address: str | None
    local_rank: int


@dataclasses.dataclass(frozen=True)
class _Names:
    """How each setting is spelled in error messages (env variable or argument)."""

    index: str
    num: str
    endpoints: str
    current: str
    coordinator: str
    local_rank: str


def _setting(name: str, value: Any) -> str:
    return f"{name}={value!r}"


def _parse_endpoint(endpoint: str, name: str) -> str:
    """Checks ``host:port`` and returns it stripped; ``name`` is for the message."""
    text = endpoint.strip()
    host, sep, port = text.rpartition(":")
    fix = f"write each endpoint as host:port, e.g. {name}=127.0.0.1:6170"
    if not sep or not host:
        raise ValueError(f"{_setting(name, endpoint)}: endpoint {text!r} has no port; {fix}.")
    try:
        port_num = int(port)
    except ValueError:
        raise ValueError(
            f"{_setting(name, endpoint)}: endpoint {text!r} has port {port!r}, "
            f"which is not an integer; {fix}."
        ) from None
    if not 0 < port_num < 65536:
        raise ValueError(
            f"{_setting(name, endpoint)}: endpoint {text!r} has port {port_num}, "
            f"outside 1..65535; {fix}."
        )
    return text


def _parse_endpoint_list(raw: str | Sequence[str], name: str) -> tuple[str, ...]:
    items = raw.split(",") if isinstance(raw, str) else list(raw)
    endpoints = []
    for item in items:
        if not isinstance(item, str):
            raise TypeError(
                f"{_setting(name, raw)}: endpoint {item!r} ({type(item).__name__}) is not a "
                "'host:port' string."
            )
        endpoints.append(_parse_endpoint(item, name))
    duplicates = sorted({e for e in endpoints if endpoints.count(e) > 1})
    if duplicates:
        raise ValueError(
            f"{_setting(name, raw)} lists {duplicates} more than once; every process needs "
            "its own host:port."
        )
    return tuple(endpoints)


def _host(endpoint: str) -> str:
    return endpoint.rpartition(":")[0]


def _resolve(
    *,
    index: int | None,
    num: int | None,
    endpoints: tuple[str, ...],
    current: str | None,
    coordinator: str | None,
    local_rank: int | None,
    names: _Names,
) -> _Layout:
    """Fills in what can be derived and rejects every contradiction."""
    if endpoints:
        if num is None:
            num = len(endpoints)
        elif num != len(endpoints):
            raise ValueError(
                f"{_setting(names.num, num)} disagrees with the {len(endpoints)} endpoints in "
                f"{_setting(names.endpoints, ','.join(endpoints))}; list exactly one endpoint "
                f"per process or fix {names.num}."
            )
    if num is None:
        if index is not None:
            raise ValueError(
                f"{_setting(names.index, index)} is set but the number of processes is not; "
                f"set {names.num} (or {names.endpoints}) too, or unset {names.index} to run "
                "as a single process."
            )
        if coordinator is not None:
            raise ValueError(
                f"{_setting(names.coordinator, coordinator)} is set but the number of processes "
                f"is not; set {names.num} and {names.index} too, or unset {names.coordinator} "
                "to run as a single process."
            )
        num = 1
    if num < 1:
        raise ValueError(f"{_setting(names.num, num)}: the number of processes must be at least 1.")
    if index is None:
        if current is not None and current in endpoints:
            index = endpoints.index(current)
        elif num == 1:
            index = 0
        else:
            raise ValueError(
                f"{_setting(names.num, num)} but {names.index} is not set; give each process "
                f"its rank {names.index}=0..{num - 1}."
            )
    if not 0 <= index < num:
        raise ValueError(
            f"{_setting(names.index, index)} must be in 0..{num - 1} because there are {num} "
            f"processes ({names.num} / {names.endpoints}); fix the rank or the process count."
        )
    if num > 1 and not endpoints and coordinator is None:
        raise ValueError(
            f"{_setting(names.num, num)} but no coordinator is known: set {names.coordinator} "
            f"(host:port of process 0) or {names.endpoints} (one host:port per process)."
        )
    if endpoints:
        if current is None:
            current = endpoints[index]
        elif current not in endpoints:
            raise ValueError(
                f"{_setting(names.current, current)} is not among "
                f"{_setting(names.endpoints, ','.join(endpoints))}; it must be this "
                f"process's entry, the one at position {names.index}={index}."
            )
        elif endpoints[index] != current:
            raise ValueError(
                f"{_setting(names.current, current)} is at position {endpoints.index(current)} "
                f"of {names.endpoints} but {_setting(names.index, index)}; the current endpoint "
                f"must be {endpoints[index]!r}, or the rank must be {endpoints.index(current)}."
            )
    if coordinator is None and endpoints:
        coordinator = endpoints[0]
    if local_rank is None:
        if endpoints:
            host = _host(endpoints[index])
            local_rank = sum(_host(e) == host for e in endpoints[:index])
        else:
            local_rank = 0
    elif not 0 <= local_rank < num:
        raise ValueError(
            f"{_setting(names.local_rank, local_rank)} must be in 0..{num - 1} "
            f"(there are {num} processes); fix or unset {names.local_rank}."
        )
    return _Layout(
        worker_index=index,
        worker_num=num,
        worker_endpoints=endpoints,
        current_endpoint=current or "",
        coordinator_address=coordinator,
        local_rank=local_rank,
    )


class RoleMakerBase:
    """What fleet asks a role maker; subclasses fill in the job's layout.

    Ranks are process ranks: one JAX process per worker, each owning its local devices.
    Paddle's underscore spellings (``_worker_index``, ``_get_trainer_endpoints``, ...)
    are aliases of the public methods.
    """

    _layout: _Layout

    def __new__(cls, is_collective: bool = True, *args: Any, **kwargs: Any) -> Any:
        if not is_collective and cls in _PS_ROLE_MAKERS:  # jfleet.ps.role_maker.PSRoleMaker
            return _PS_ROLE_MAKERS[cls](*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, is_collective: bool = True) -> None:
        if not is_collective:
            raise NotImplementedError(_PS_MESSAGE)
        self._is_collective = True
        self._role = Role.WORKER

    @property
    def is_collective(self) -> bool:
        """False for the parameter-server role maker (``jfleet.ps.PSRoleMaker``)."""
        return self._is_collective

    @property
    def role(self) -> Role:
        """This process's :class:`Role` (always ``Role.WORKER`` in collective mode)."""
        return self._role

    def worker_index(self) -> int:
        """This process's rank among workers, ``0..worker_num() - 1``."""
        return self._layout.worker_index

    def worker_num(self) -> int:
        """The number of worker processes (JAX processes)."""
        return self._layout.worker_num

    def is_worker(self) -> bool:
        """Whether this process is a worker (always, in collective mode)."""
        return self._role == Role.WORKER

    def is_server(self) -> bool:
        """Whether this process is a parameter server (never, in collective mode)."""
        return self._role == Role.SERVER

    def is_first_worker(self) -> bool:
        """Whether this process is worker 0."""
        return self.is_worker() and self.worker_index() == 0

    def server_num(self) -> int:
        """The number of parameter servers: 0 in collective mode."""
        return 0

    def node_num(self) -> int:
        """The number of distinct hosts among the worker endpoints.

        Without endpoints (only a coordinator address is known) each process is counted
        as its own node.
        """
        if self._layout.worker_endpoints:
            return len({_host(e) for e in self._layout.worker_endpoints})
        return self._layout.worker_num

    def local_rank(self) -> int:
        """This process's rank on its host: ``PADDLE_RANK_IN_NODE`` if given, else its
        position among the endpoints that share its host (0 without endpoints)."""
        return self._layout.local_rank

    def worker_endpoints(self) -> list[str]:
        """Every worker's ``host:port`` in rank order; empty when none were given."""
        return list(self._layout.worker_endpoints)

    def current_endpoint(self) -> str:
        """This process's ``host:port``; ``""`` when not known."""
        return self._layout.current_endpoint

    def coordinator_address(self) -> str | None:
        """``host:port`` of the JAX coordinator (process 0); ``None`` for one process
        started without any address."""
        return self._layout.coordinator_address

    # Paddle's private spellings, which Paddle's own fleet code calls.
    def _worker_index(self) -> int:
        return self.worker_index()

    def _worker_num(self) -> int:
        return self.worker_num()

    def _is_worker(self) -> bool:
        return self.is_worker()

    def _is_server(self) -> bool:
        return self.is_server()

    def _is_first_worker(self) -> bool:
        return self.is_first_worker()

    def _server_num(self) -> int:
        return self.server_num()

    def _node_num(self) -> int:
        return self.node_num()

    def _get_local_rank(self) -> int:
        return self.local_rank()

    def _get_trainer_endpoints(self) -> list[str]:
        return self.worker_endpoints()

    def _get_pserver_endpoints(self) -> list[str]:
        return []

    def _get_current_endpoint(self) -> str:
        return self.current_endpoint()

    def _is_non_distributed(self) -> bool:
        return self.worker_num() == 1

    def _generate_role(self) -> None:
        """Paddle resolves the role lazily here; jfleet already did in ``__init__``."""

    def __repr__(self) -> str:
        layout = self._layout
        return (
            f"{type(self).__name__}(worker_index={layout.worker_index}, "
            f"worker_num={layout.worker_num}, worker_endpoints={list(layout.worker_endpoints)}, "
            f"coordinator_address={layout.coordinator_address!r}, "
            f"local_rank={layout.local_rank})"
        )


def _env(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    value = _env(environ, name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"{_setting(name, environ[name])} is not an integer; set it to a whole number "
            "or unset it."
        ) from None


def _env_pair(
    environ: Mapping[str, str], paddle_name: str, jax_name: str, parse: Any
) -> tuple[Any, str]:
    """Reads a setting spelled two ways; returns (value, the name it came from)."""
    paddle_value, jax_value = parse(environ, paddle_name), parse(environ, jax_name)
    if paddle_value is not None and jax_value is not None and paddle_value != jax_value:
        raise ValueError(
            f"{_setting(paddle_name, environ[paddle_name])} and "
            f"{_setting(jax_name, environ[jax_name])} disagree; set one of them, or both "
            "to the same value."
        )
    if paddle_value is not None:
        return paddle_value, paddle_name
    return jax_value, jax_name if jax_value is not None else paddle_name


class PaddleCloudRoleMaker(RoleMakerBase):
    """A role maker that reads the job from Paddle's (or JAX's) environment variables.

    Read at construction: ``PADDLE_TRAINER_ID`` (or ``JAX_PROCESS_ID``),
    ``PADDLE_TRAINERS_NUM`` (or ``JAX_NUM_PROCESSES``), ``PADDLE_TRAINER_ENDPOINTS``
    (comma-separated ``host:port``, one per process in rank order),
    ``PADDLE_CURRENT_ENDPOINT``, ``PADDLE_MASTER`` (or ``JAX_COORDINATOR_ADDRESS``),
    ``PADDLE_RANK_IN_NODE`` and ``PADDLE_TRAINING_ROLE``. With none set the job is one
    process of rank 0. The coordinator is ``PADDLE_MASTER`` /
    ``JAX_COORDINATOR_ADDRESS`` if set, else the first endpoint.

    Args:
      is_collective: False returns a ``jfleet.ps.PSRoleMaker`` (parameter-server mode).
      environ: the variables to read; default ``os.environ``.
      **kwargs: Paddle's other options (e.g. gloo paths); accepted and ignored,
        since JAX provides the host-level collectives.

    Raises:
      NotImplementedError: ``is_collective=False``.
      ValueError: a malformed, missing or contradictory variable; the message names it.

    Example:
      >>> from jfleet.runtime.role_maker import PaddleCloudRoleMaker
      >>> rm = PaddleCloudRoleMaker()  # no PADDLE_* variables: one process
      >>> rm.worker_num(), rm.worker_index()
      (1, 0)
    """

    def __init__(
        self,
        is_collective: bool = True,
        *,
        environ: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(is_collective)
        if kwargs:
            logger.debug("PaddleCloudRoleMaker ignores options %s", sorted(kwargs))
        env = os.environ if environ is None else environ
        role = _env(env, "PADDLE_TRAINING_ROLE")
        if role is not None and role.upper() != "TRAINER":
            raise ValueError(
                f"{_setting('PADDLE_TRAINING_ROLE', role)}: collective jobs have only "
                "TRAINER processes (parameter-server roles need is_collective=False); "
                "set it to TRAINER or unset it."
            )
        index, index_name = _env_pair(env, "PADDLE_TRAINER_ID", "JAX_PROCESS_ID", _env_int)
        num, num_name = _env_pair(env, "PADDLE_TRAINERS_NUM", "JAX_NUM_PROCESSES", _env_int)
        coordinator, coordinator_name = _env_pair(
            env, "PADDLE_MASTER", "JAX_COORDINATOR_ADDRESS", _env
        )
        if coordinator is not None:
            coordinator = _parse_endpoint(coordinator, coordinator_name)
        raw_endpoints = _env(env, "PADDLE_TRAINER_ENDPOINTS")
        endpoints = (
            _parse_endpoint_list(raw_endpoints, "PADDLE_TRAINER_ENDPOINTS")
            if raw_endpoints is not None
            else ()
        )
        current = _env(env, "PADDLE_CURRENT_ENDPOINT")
        if current is not None:
            current = _parse_endpoint(current, "PADDLE_CURRENT_ENDPOINT")
        names = _Names(
            index=index_name,
            num=num_name,
            endpoints="PADDLE_TRAINER_ENDPOINTS",
            current="PADDLE_CURRENT_ENDPOINT",
            coordinator=coordinator_name,
            local_rank="PADDLE_RANK_IN_NODE",
        )
        nothing_set = all(v is None for v in (index, num, coordinator, raw_endpoints, current))
        self._layout = _resolve(
            index=index,
            num=num,
            endpoints=endpoints,
            current=current,
            coordinator=coordinator,
            local_rank=_env_int(env, "PADDLE_RANK_IN_NODE"),
            names=names,
        )
        if nothing_set:
            logger.debug(
                "No PADDLE_* / JAX_* process variables set: running as one process, rank 0."
            )
        else:
            logger.debug("Role from the environment: %r", self)


class UserDefinedRoleMaker(RoleMakerBase):
    """A role maker whose job layout is given as arguments.

    Args:
      is_collective: False returns a ``jfleet.ps.PSRoleMaker`` (parameter-server mode).
      init_gloo: accepted for Paddle compatibility; JAX provides host collectives.
      current_id: this process's rank, ``0..worker_num - 1``.
      role: must be ``Role.WORKER`` in collective mode.
      worker_num: the number of processes; 0 means ``len(worker_endpoints)`` (or 1).
      worker_endpoints: ``host:port`` of every process in rank order (a list or a
        comma-separated string); the first is the coordinator unless
        ``coordinator_address`` is given.
      server_endpoints: parameter-server endpoints; ignored in collective mode.
      **kwargs: ``coordinator_address`` (``host:port`` of process 0), needed when
        ``worker_num > 1`` and no endpoints are given; other keys are ignored.

    Raises:
      NotImplementedError: ``is_collective=False``.
      TypeError: an argument of the wrong type.
      ValueError: a contradictory layout; the message names the argument.

    Example:
      >>> from jfleet.runtime.role_maker import UserDefinedRoleMaker
      >>> rm = UserDefinedRoleMaker(current_id=0, worker_num=2,
      ...                           worker_endpoints="127.0.0.1:6170,127.0.0.1:6171")
      >>> rm.current_endpoint(), rm.coordinator_address()
      ('127.0.0.1:6170', '127.0.0.1:6170')
    """

    def __init__(
        self,
        is_collective: bool = True,
        init_gloo: bool = False,
        current_id: int = 0,
        role: Role | int = Role.WORKER,
        worker_num: int = 0,
        worker_endpoints: Sequence[str] | str | None = None,
        server_endpoints: Sequence[str] | str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(is_collective)
        for name, value in (("current_id", current_id), ("worker_num", worker_num)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{_setting(name, value)} ({type(value).__name__}) must be an int.")
        try:
            role = Role(role)
        except ValueError:
            raise ValueError(
                f"role={role!r} is not a Role; use one of {[r.name for r in Role]}."
            ) from None
        if role != Role.WORKER:
            raise ValueError(
                f"role={role!r}: collective jobs have only Role.WORKER processes "
                "(parameter-server roles need is_collective=False); pass "
                "role=Role.WORKER."
            )
        if worker_num < 0:
            raise ValueError(f"worker_num={worker_num} must be >= 0 (0: one per endpoint).")
        if current_id < 0:
            raise ValueError(f"current_id={current_id} must be >= 0.")
        if server_endpoints:
            logger.warning(
                "UserDefinedRoleMaker ignores server_endpoints=%r in collective mode.",
                server_endpoints,
            )
        if init_gloo:
            logger.debug("UserDefinedRoleMaker ignores init_gloo=True; JAX runs collectives.")
        coordinator = kwargs.pop("coordinator_address", None)
        if coordinator is not None:
            if not isinstance(coordinator, str):
                raise TypeError(
                    f"coordinator_address={coordinator!r} must be a 'host:port' string."
                )
            coordinator = _parse_endpoint(coordinator, "coordinator_address")
        if kwargs:
            logger.debug("UserDefinedRoleMaker ignores options %s", sorted(kwargs))
        endpoints = (
            _parse_endpoint_list(worker_endpoints, "worker_endpoints") if worker_endpoints else ()
        )
        names = _Names(
            index="current_id",
            num="worker_num",
            endpoints="worker_endpoints",
            current="current endpoint",
            coordinator="coordinator_address",
            local_rank="local rank",
        )
        self._layout = _resolve(
            index=current_id,
            num=worker_num or len(endpoints) or 1,
            endpoints=endpoints,
            current=None,
            coordinator=coordinator,
            local_rank=None,
            names=names,
        )
