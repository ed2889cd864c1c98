"""Emulated CPU devices for tests: set the count before JAX starts, and say so when it is short.

JAX fixes its device count when its backend starts (the first ``jax.devices()`` or array
operation), not at ``import jax``. :func:`emulate_cpu_devices` sets the count before that
point (what ``pytest --jfleet-devices N`` and the repository's ``conftest.py`` call);
:func:`require_devices` is the check a test helper makes before it builds a mesh, with
the fix in its message.

Example:
  >>> import jax
  >>> emulate_cpu_devices(len(jax.devices()))  # already started: the same count is fine
  >>> require_devices(1)
"""

from __future__ import annotations

from jfleet.runtime.devices import fix_hint, set_process_devices

__all__ = ["NotEnoughDevicesError", "emulate_cpu_devices", "require_devices"]


class NotEnoughDevicesError(RuntimeError):
    """A test needs more devices than this process has.

    Example:
      >>> try:
      ...     require_devices(1024)
      ... except NotEnoughDevicesError as err:
      ...     print(str(err).split(":")[0])
      this test needs 1024 devices, but this process has 8
    """


def _check_count(n: int, name: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name}={n!r}: expected a positive int (a device count).")


def emulate_cpu_devices(n: int) -> None:
    """Makes this process's JAX run on ``n`` emulated CPU devices.

    Sets ``jax_num_cpu_devices`` and, unless ``JAX_PLATFORMS`` is set, the CPU platform.
    Call it before anything starts JAX's backend; after, only the count it already has
    is accepted.

    Raises:
      ValueError: ``n`` is not a positive int.
      RuntimeError: JAX already started with another count (the message says where to
        set it instead).

    Example:
      >>> import jax
      >>> emulate_cpu_devices(jax.device_count())  # started already: the same count is fine
    """
    _check_count(n, "n")
    set_process_devices(n)


def require_devices(n: int, what: str = "this test") -> None:
    """Checks that this process has at least ``n`` devices.

    Raises:
      NotEnoughDevicesError: fewer; the message names the pytest option that fixes it.

    Example:
      >>> require_devices(2, "a dp2 test")
    """
    _check_count(n, "n")
    import jax

    have = len(jax.devices())
    if have < n:
        raise NotEnoughDevicesError(
            f"{what} needs {n} devices, but this process has {have}: run pytest with "
            f"--jfleet-devices {n} (or `jfleet_devices = {n}` in the pytest ini file), or mark "
            f"the test @pytest.mark.jfleet_devices({n}) to run it in a child process. "
            + fix_hint(n)
        )
