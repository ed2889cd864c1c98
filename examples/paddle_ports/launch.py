"""Runs a ported Paddle script as ``python -m paddle.distributed.launch --devices ...`` would.

Paddle starts one process per GPU and each script sees its own rank. jfleet is SPMD: one
process drives every device, and a script's degrees (``mp_degree=2``, ...) must multiply
to the devices its mesh spans. Paddle's tests run these scripts on 2 or 4 GPUs; on a
machine with more devices, this launcher hands ``fleet.init`` the first ``devices`` of
them (``fleet.init(devices=...)``), as ``--devices 0,1`` does for Paddle's launcher, and
runs the script unchanged as ``__main__``.

    cd examples/paddle_ports && python launch.py --devices 2 hybrid_parallel_mp_layers.py

With no accelerator, 8 CPU devices are emulated.

Example:
  >>> import launch
  >>> launch.DEVICES["hybrid_parallel_mp_layers.py"]
  2
"""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import sys
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

#: The GPUs Paddle's own test driver gives each script (test/collective/fleet/*.py).
DEVICES = {
    "hybrid_parallel_mp_layers.py": 2,
    "hybrid_parallel_pp_embedding.py": 2,
    "hybrid_parallel_shared_weight.py": 2,
    "hybrid_parallel_pp_transformer.py": 2,
    "hybrid_parallel_communicate_group.py": 2,
    "dygraph_group_sharded_api_eager.py": 2,
}


@contextlib.contextmanager
def selected_devices(count: int) -> Iterator[None]:
    """``fleet.init`` (and whatever starts a fleet) and ``fleet.HybridCommunicateGroup``
    span the first ``count`` devices unless given others."""
    import jax

    from jfleet import fleet

    devices = jax.devices()[:count]
    if len(devices) < count:
        raise ValueError(
            f"--devices {count} asks for more devices than the {len(jax.devices())} present; "
            "pass at most that many (or emulate more with JAX_NUM_CPU_DEVICES)."
        )
    original_init, original_hcg = fleet.init, fleet.HybridCommunicateGroup
    chosen = devices

    def init(*args, devices=None, **kwargs):
        return original_init(*args, devices=chosen if devices is None else devices, **kwargs)

    class HybridCommunicateGroup(original_hcg):
        def __init__(self, topology, devices=None, **kwargs):
            super().__init__(topology, devices=chosen if devices is None else devices, **kwargs)

    fleet.init, fleet.HybridCommunicateGroup = init, HybridCommunicateGroup
    try:
        yield
    finally:
        fleet.init, fleet.HybridCommunicateGroup = original_init, original_hcg


def run(script: str | Path, devices: int | None = None) -> None:
    """Runs ``script`` as ``__main__`` on its devices; raises if the script fails.

    ``unittest.main()`` exits through ``SystemExit``: a zero status passes, any other
    raises ``AssertionError`` (the failures are on stderr).
    """
    path = Path(script).resolve()
    count = DEVICES.get(path.name) if devices is None else devices
    if count is None:
        raise ValueError(f"{path.name} has no device count; pass devices= (e.g. 2).")
    argv, sys.argv = sys.argv, [str(path)]
    added = str(path.parent) not in sys.path
    if added:
        sys.path.insert(0, str(path.parent))
    try:
        with selected_devices(count):
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit as done:
        if done.code not in (0, None, False):
            raise AssertionError(f"{path.name} failed (exit status {done.code!r})") from None
    finally:
        sys.argv = argv
        if added:
            sys.path.remove(str(path.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=None, help="devices the mesh spans")
    parser.add_argument("script", help="a ported script")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        # As the test suite compiles: without LLVM's reassociating passes a split sum
        # matches the one-device sum to Paddle's default tolerance (rtol 1e-7).
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()
    import jax

    if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        jax.config.update("jax_num_cpu_devices", 8)
    run(args.script, args.devices)


if __name__ == "__main__":
    main()
