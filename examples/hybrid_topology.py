"""Prints the hybrid-parallel layout a strategy yields on 8 emulated CPU devices.

    python examples/hybrid_topology.py              # dp 2 x pp 2 x mp 2
    python examples/hybrid_topology.py --mp 4 --sharding 2 --dp 1 --pp 1
    python examples/hybrid_topology.py --dp 2 --ep 4 --pp 1 --mp 1   # an expert axis

Set JAX_PLATFORMS to use real accelerators instead of emulated CPU devices.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax

from jfleet import fleet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    axes = (("dp", 2), ("pp", 2), ("sharding", 1), ("sep", 1), ("ep", 1), ("mp", 2))
    for axis, default in axes:
        parser.add_argument(f"--{axis}", type=int, default=default, help=f"{axis}_degree")
    parser.add_argument("--devices", type=int, default=8, help="emulated CPU devices")
    args = parser.parse_args()
    if os.environ["JAX_PLATFORMS"] == "cpu":
        jax.config.update("jax_num_cpu_devices", args.devices)

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {f"{axis}_degree": getattr(args, axis) for axis, _ in axes}
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    hcg = fleet.get_hybrid_communicate_group()
    topo = fleet.get_hybrid_parallel_topology()

    print(strategy)
    print(f"parallel mode: {hcg.get_parallel_mode().name}")
    print(f"mesh axes: {dict(hcg.mesh.shape)}")
    print("rank -> coordinate -> device")
    for rank, device in enumerate(hcg.mesh.devices.flat):
        print(f"  {rank:2d}  {tuple(topo.get_coord(rank))}  {device}")
    for name in topo.get_hybrid_group_names():
        print(f"{name:>8} groups: {topo.get_comm_list(name)}")


if __name__ == "__main__":
    main()
