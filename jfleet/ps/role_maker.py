"""Paddle's parameter-server roles, mapped onto one SPMD job.

Under SPMD there are no separate server processes: every sparse table is sharded over the
devices of every process (:mod:`jfleet.ps.table`), so **every process is both a worker and
a server**. ``is_worker()`` and ``is_server()`` are True everywhere; ``server_num()`` is the
number of processes (the hosts of table shards), ``server_index()`` this process's index.

Paddle's PS variables say which processes the job has, and in what order:

* ``TRAINING_ROLE`` (``TRAINER`` or ``PSERVER``), ``PADDLE_PSERVERS_IP_PORT_LIST`` (S
  server endpoints) and ``PADDLE_TRAINERS_NUM`` (T) are required together, as in Paddle;
  a ``TRAINER`` reads ``PADDLE_TRAINER_ID``, a ``PSERVER`` its endpoint ``POD_IP`` :
  ``PADDLE_PORT``, which must be in the list.
* The job is S + T JAX processes: server ``j`` is process ``j``, trainer ``i`` is process
  ``S + i``. Each runs the same script and trains: write Paddle's ``if fleet.is_server():
  ... run_server()`` and ``if fleet.is_worker(): ...`` as two ``if`` s (an ``elif`` would
  skip training on every process; ``run_server`` returns at once).
* The JAX coordinator is server 0's endpoint (process 0 listens there).
  ``PADDLE_TRAINER_ENDPOINTS`` (T endpoints), when set, completes the endpoint list.

With no ``TRAINING_ROLE``, the collective variables decide (``jfleet.launch`` sets them):
the layout of :class:`~jfleet.role_maker.PaddleCloudRoleMaker`, each process a worker and a
server. With nothing set: one process.

Example:
  >>> rm = PSRoleMaker.from_env({"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "1",
  ...     "PADDLE_TRAINERS_NUM": "2", "PADDLE_PSERVERS_IP_PORT_LIST": "10.0.0.1:6000"})
  >>> rm.worker_index(), rm.worker_num(), rm.server_num(), rm.coordinator_address()
  (2, 3, 3, '10.0.0.1:6000')
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from jfleet.runtime import role_maker as _rm
from jfleet.runtime.log import logger
from jfleet.runtime.role_maker import Role, RoleMakerBase

__all__ = ["PSRoleMaker"]

_ROLES = ("TRAINER", "PSERVER")


def _missing(name: str) -> ValueError:
    return ValueError(
        f"Can not find {name}, please check your environment: a parameter-server job sets "
        "TRAINING_ROLE, PADDLE_PSERVERS_IP_PORT_LIST and PADDLE_TRAINERS_NUM together "
        "(unset TRAINING_ROLE to take the collective variables instead)."
    )


class PSRoleMaker(RoleMakerBase):
    """The role maker of ``fleet.init(is_collective=False)``: every process a worker and a server.

    Build it with :meth:`from_env` (what ``PaddleCloudRoleMaker(is_collective=False)``
    returns) or :meth:`from_user` (``UserDefinedRoleMaker(is_collective=False, ...)``).

    Attributes:
      paddle_role: the role Paddle's variables gave (``"TRAINER"``, ``"PSERVER"``), or None.
    """

    def __init__(self, layout: Any, server_endpoints: Sequence[str], paddle_role: str | None):
        super().__init__(is_collective=True)
        self._is_collective = False
        self._role = Role.ALL
        self._layout = layout
        self._servers = tuple(server_endpoints)
        self.paddle_role = paddle_role
        logger.debug("parameter-server role: %r", self)

    # ------------------------------------------------------------ builders
    @classmethod
    def _from_roles(
        cls,
        *,
        role: str,
        index: int,
        trainers: int,
        servers: tuple[str, ...],
        trainer_endpoints: tuple[str, ...],
        names: tuple[str, str, str],
    ) -> PSRoleMaker:
        """Server ``j`` is process ``j``; trainer ``i`` is process ``S + i``."""
        num_name, trainers_name, id_name = names
        if trainers < 0:
            raise ValueError(f"{num_name}={trainers}: expected >= 0 trainers.")
        if trainer_endpoints and len(trainer_endpoints) != trainers:
            raise ValueError(
                f"{trainers_name} lists {len(trainer_endpoints)} endpoints but {num_name}="
                f"{trainers}; list one endpoint per trainer."
            )
        if role == "TRAINER" and not 0 <= index < trainers:
            raise ValueError(
                f"{id_name}={index} must be in 0..{trainers - 1} ({num_name}={trainers})."
            )
        process = index if role == "PSERVER" else len(servers) + index
        endpoints = servers + trainer_endpoints if trainer_endpoints else ()
        layout = _rm._resolve(
            index=process,
            num=len(servers) + trainers,
            endpoints=endpoints,
            current=None,
            coordinator=servers[0],
            local_rank=None,
            names=_rm._Names(id_name, num_name, trainers_name, "current endpoint", "", ""),
        )
        return cls(layout, servers, role)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **kwargs: Any) -> PSRoleMaker:
        """Reads Paddle's PS variables (module docstring); ``kwargs`` are Paddle's options,
        ignored (logged).

        Raises:
          ValueError: a missing, malformed or contradictory variable; the message names it.
        """
        if kwargs:
            logger.info("PaddleCloudRoleMaker(is_collective=False) ignores %s", sorted(kwargs))
        env = os.environ if environ is None else environ
        role = _rm._env(env, "TRAINING_ROLE")
        if role is None:
            collective = _rm.PaddleCloudRoleMaker(environ=env)
            return cls(collective._layout, collective.worker_endpoints(), None)
        role = role.upper()
        if role not in _ROLES:
            raise ValueError(
                f"TRAINING_ROLE={role!r}: expected TRAINER or PSERVER (heter trainers and "
                "coordinators have no SPMD counterpart)."
            )
        raw = _rm._env(env, "PADDLE_PSERVERS_IP_PORT_LIST")
        if raw is None:
            raise _missing("PADDLE_PSERVERS_IP_PORT_LIST")
        servers = _rm._parse_endpoint_list(raw, "PADDLE_PSERVERS_IP_PORT_LIST")
        trainers = _rm._env_int(env, "PADDLE_TRAINERS_NUM")
        if trainers is None:
            raise _missing("PADDLE_TRAINERS_NUM")
        raw_trainers = _rm._env(env, "PADDLE_TRAINER_ENDPOINTS")
        trainer_endpoints = (
            _rm._parse_endpoint_list(raw_trainers, "PADDLE_TRAINER_ENDPOINTS")
            if raw_trainers
            else ()
        )
        if role == "TRAINER":
            index = _rm._env_int(env, "PADDLE_TRAINER_ID")
            if index is None:
                raise _missing("PADDLE_TRAINER_ID")
        else:
            ip, port = _rm._env(env, "POD_IP"), _rm._env(env, "PADDLE_PORT")
            if ip is None or port is None:
                raise _missing("POD_IP" if ip is None else "PADDLE_PORT")
            current = _rm._parse_endpoint(f"{ip}:{port}", "POD_IP:PADDLE_PORT")
            if current not in servers:
                raise ValueError(
                    f"POD_IP:PADDLE_PORT={current!r} is not in PADDLE_PSERVERS_IP_PORT_LIST="
                    f"{raw!r}; a PSERVER process must be one of the listed servers."
                )
            index = servers.index(current)
        return cls._from_roles(
            role=role,
            index=index,
            trainers=trainers,
            servers=servers,
            trainer_endpoints=trainer_endpoints,
            names=("PADDLE_TRAINERS_NUM", "PADDLE_TRAINER_ENDPOINTS", "PADDLE_TRAINER_ID"),
        )

    @classmethod
    def from_user(
        cls,
        init_gloo: bool = False,
        current_id: int = 0,
        role: Role | int = Role.WORKER,
        worker_num: int = 0,
        worker_endpoints: Sequence[str] | str | None = None,
        server_endpoints: Sequence[str] | str | None = None,
        **kwargs: Any,
    ) -> PSRoleMaker:
        """``UserDefinedRoleMaker(is_collective=False, ...)``: the same layout from arguments
        (``role`` WORKER is a trainer, SERVER a server; ``server_endpoints`` required).

        Raises:
          ValueError: no server endpoints; another role; an index out of range.
        """
        if init_gloo or kwargs:
            logger.info("UserDefinedRoleMaker(is_collective=False) ignores init_gloo / %s", kwargs)
        try:
            role = Role(role)
        except ValueError:
            raise ValueError(f"role={role!r}: expected Role.WORKER or Role.SERVER.") from None
        if role not in (Role.WORKER, Role.SERVER):
            raise ValueError(f"role={role!r}: expected Role.WORKER or Role.SERVER.")
        if not server_endpoints:
            raise ValueError(
                "UserDefinedRoleMaker(is_collective=False) needs server_endpoints=[host:port, "
                "...]: server 0's endpoint is the job's coordinator."
            )
        servers = _rm._parse_endpoint_list(server_endpoints, "server_endpoints")
        trainers = (
            _rm._parse_endpoint_list(worker_endpoints, "worker_endpoints")
            if worker_endpoints
            else ()
        )
        if role == Role.SERVER and not 0 <= current_id < len(servers):
            raise ValueError(
                f"current_id={current_id}: a server's id must be in 0..{len(servers) - 1}."
            )
        return cls._from_roles(
            role="PSERVER" if role == Role.SERVER else "TRAINER",
            index=current_id,
            trainers=worker_num or len(trainers),
            servers=servers,
            trainer_endpoints=trainers,
            names=("worker_num", "worker_endpoints", "current_id"),
        )

    # ------------------------------------------------------------- answers
    def is_worker(self) -> bool:
        """True: every process trains."""
        return True

    def is_server(self) -> bool:
        """True: every process holds a shard of every table."""
        return True

    def server_num(self) -> int:
        """The number of processes holding table shards: all of them."""
        return self.worker_num()

    def server_index(self) -> int:
        """This process's index among the shard hosts (its process index)."""
        return self.worker_index()

    def server_endpoints(self) -> list[str]:
        """The shard hosts' endpoints as far as known: every process's when the trainers'
        endpoints were given, else Paddle's server list (the first processes)."""
        return self.worker_endpoints() or list(self._servers)

    def _server_index(self) -> int:
        return self.server_index()

    def _get_pserver_endpoints(self) -> list[str]:
        return self.server_endpoints()

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, paddle_role={self.paddle_role!r})"


# PaddleCloudRoleMaker / UserDefinedRoleMaker(is_collective=False) build a PSRoleMaker.
_rm._PS_ROLE_MAKERS.update(
    {
        _rm.PaddleCloudRoleMaker: PSRoleMaker.from_env,
        _rm.UserDefinedRoleMaker: PSRoleMaker.from_user,
    }
)
