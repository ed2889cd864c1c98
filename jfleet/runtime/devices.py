"""Emulated CPU devices for your scripts: ``jfleet.emulate_devices(8)``, ``JFLEET_CPU_DEVICES``.

A CPU-only machine has one JAX device; meshes of 8 need 8. JAX can split the host CPU into
``n`` devices, but only when told before its backend starts (the first ``jax.devices()`` or
array operation; ``import jax`` and ``import jfleet`` do not start it). Either call
:func:`emulate_devices` at the top of the script, or set ``JFLEET_CPU_DEVICES=8`` in the
environment (read at ``import jfleet``).

The count is for the whole job: under ``python -m jfleet.launch --nproc_per_node 2`` each
process takes ``n / 2``, so one script runs unchanged in one process and under the launcher.
A count the launcher gave the worker (``--devices``: ``JAX_NUM_CPU_DEVICES``) wins.

Example:
  >>> import jax
  >>> emulate_devices(len(jax.devices()))  # JAX already started: the same count is fine
"""

from __future__ import annotations

import os

__all__ = ["emulate_devices"]

#: The variable :func:`emulate_from_env` reads at ``import jfleet``.
ENV_VAR = "JFLEET_CPU_DEVICES"


def _processes() -> int:
    for name in ("JAX_NUM_PROCESSES", "PADDLE_TRAINERS_NUM"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def _per_process(n: int) -> int:
    if os.environ.get("JAX_NUM_CPU_DEVICES", "").isdigit():
        return int(os.environ["JAX_NUM_CPU_DEVICES"])  # the launcher's --devices share
    procs = _processes()
    if n % procs:
        raise ValueError(
            f"emulate_devices({n}): {n} devices cannot be split evenly over the job's "
            f"{procs} processes; pass a multiple of {procs} (the count is for the whole job)."
        )
    return n // procs


def emulate_devices(n: int) -> None:
    """Makes JAX run on ``n`` emulated CPU devices in all (this process's share of them).

    Call it before anything starts JAX's backend (the first ``jax.devices()`` or array
    operation). Sets ``jax_num_cpu_devices`` only: on a machine with GPUs or TPUs JAX still
    runs on them (the call changes nothing there), so a script may call it unconditionally.
    Under a launcher with ``p`` processes each gets ``n / p``; a launcher's ``--devices``
    share (``JAX_NUM_CPU_DEVICES``) wins.

    Args:
      n: devices of the whole job, a positive int.

    Raises:
      ValueError: ``n`` is not a positive int, or not a multiple of the process count.
      RuntimeError: JAX already started with another count (set it earlier: at the top
        of the script, or with ``JFLEET_CPU_DEVICES``).

    Example:
      >>> import jax
      >>> emulate_devices(jax.device_count())
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"emulate_devices(n={n!r}): expected a positive int (a device count).")
    set_process_devices(_per_process(n), force_cpu=False)


def set_process_devices(local: int, *, force_cpu: bool = True) -> None:
    """Sets this process's CPU device count before JAX starts (the same count after is fine).

    Args:
      local: CPU devices of this process.
      force_cpu: also make CPU the platform, unless ``JAX_PLATFORMS`` is set (tests).

    Raises:
      RuntimeError: JAX already started with another count.

    Example:
      >>> import jax
      >>> set_process_devices(len(jax.local_devices(backend="cpu")))
    """
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", local)  # raises once the backend started
        if force_cpu and "JAX_PLATFORMS" not in os.environ:
            os.environ["JAX_PLATFORMS"] = "cpu"  # children inherit it
            jax.config.update("jax_platforms", "cpu")
    except RuntimeError as err:
        have = len(jax.local_devices(backend="cpu"))
        if have != local:
            raise RuntimeError(
                f"JAX already started with {have} device(s), so it cannot emulate {local}: "
                "call jfleet.emulate_devices(N) at the top of the script, before any JAX "
                f"computation, or set {ENV_VAR}=N in the environment (pytest: "
                "--jfleet-devices N)."
            ) from err


def emulate_from_env() -> None:
    """Applies ``JFLEET_CPU_DEVICES`` when set (called by ``import jfleet``).

    Raises:
      ValueError: the variable is not a positive int.

    Example:
      >>> emulate_from_env()  # unset here: nothing happens
    """
    value = os.environ.get(ENV_VAR, "").strip()
    if not value:
        return
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{ENV_VAR}={value!r}: expected a positive int (devices of the job).")
    emulate_devices(int(value))


def fix_hint(needed: int) -> str:
    """The sentence device-count errors end with: how to get ``needed`` devices on a CPU.

    Example:
      >>> "emulate_devices(8)" in fix_hint(8)
      True
    """
    return (
        f"On a CPU-only machine, emulate them: call jfleet.emulate_devices({needed}) at the "
        f"top of the script (before any JAX computation) or set {ENV_VAR}={needed}."
    )
