"""``python -m jfleet.collective_perf``: time collectives over mesh-axis groups, print a table.

Sizes x operations x groups, one row each; ``--plot`` writes bus bandwidth against size
(matplotlib), ``--json`` the results. Under ``python -m jfleet.launch`` every process
measures and process 0 prints and writes::

    python -m jfleet.collective_perf --mesh dp=2,mp=4 --groups dp,mp,world \\
        --sizes 1KB,1MB,16MB --round 20 --devices 8 --plot perf.png --json perf.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jfleet.mesh.collective_perf.report import format_table, parse_size, plot
from jfleet.mesh.collective_perf.timing import OPS, WORLD, _check_op, _positive_int, group_of, sweep
from jfleet.mesh.hybrid_group import build_hybrid_communicate_group
from jfleet.mesh.topology import AXIS_NAMES, DP, MP
from jfleet.runtime.log import set_log_level
from jfleet.runtime.role_maker import PaddleCloudRoleMaker
from jfleet.runtime.startup import initialize_distributed

__all__ = ["default_mesh", "main"]


def _arg(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def wrapped(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from err

    return wrapped


def _parse_mesh(text: str) -> dict[str, int]:
    degrees = {}
    for item in text.split(","):
        axis, sep, degree = item.strip().partition("=")
        if not sep or axis not in AXIS_NAMES or not degree.isdigit() or int(degree) < 1:
            raise ValueError(
                f"--mesh {text!r}: {item!r} is not axis=degree with axis one of "
                f"{', '.join(AXIS_NAMES)} and a positive degree, e.g. {DP}=2,{MP}=4."
            )
        degrees[f"{axis}_degree"] = int(degree)
    return degrees


def default_mesh(devices: int, groups: Sequence[str]) -> dict[str, int]:
    """``hybrid_configs`` splitting ``devices`` between the mesh axes ``groups`` name, as
    evenly as the prime factors allow, inner axes (``mp``) taking the larger share.

    Example:
      >>> default_mesh(8, ["dp", "mp", "world"]), default_mesh(6, ["dp+mp"])
      ({'dp_degree': 2, 'mp_degree': 4}, {'dp_degree': 2, 'mp_degree': 3})
    """
    named = {a for g in groups if g != WORLD for a in g.split("+")}
    axes = [a for a in AXIS_NAMES if a in named]
    if not axes:
        return {}
    degrees = dict.fromkeys(axes, 1)
    left, factor, primes = devices, 2, []
    while left > 1:
        while left % factor == 0:
            primes.append(factor)
            left //= factor
        factor += 1
    for prime in sorted(primes, reverse=True):
        smallest = min(degrees.values())
        inner = [a for a in axes if degrees[a] == smallest][-1]
        degrees[inner] *= prime
    return {f"{a}_degree": d for a, d in degrees.items()}


def _parse_ops(text: str) -> tuple[str, ...]:
    ops = OPS if text == "all" else tuple(t.strip() for t in text.split(","))
    for op in ops:
        _check_op(op, "--ops entry")
    return ops


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jfleet.collective_perf",
        description="Time collectives over mesh-axis groups; print a table.",
    )
    p.add_argument("--ops", type=_arg(_parse_ops), default=OPS, help="'all' or e.g. allreduce")
    p.add_argument("--groups", default=f"{DP},{MP},{WORLD}", help="mesh axes, a+b, or world")
    p.add_argument("--sizes", default="1KB,1MB,16MB", help="bytes per rank, e.g. 1KB,1MB")
    p.add_argument("--round", type=int, default=20, help="timed calls per row")
    p.add_argument(
        "--mesh",
        type=_arg(_parse_mesh),
        default=None,
        help="e.g. dp=2,mp=4; default: the devices split between the axes --groups names",
    )
    p.add_argument("--devices", type=int, default=None, help="emulated CPU devices per process")
    p.add_argument("--plot", default=None, help="write busbw vs size to this PNG")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--log_level", default="WARNING")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jfleet.collective_perf``: measure, print the table (process 0 only)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
        groups = [g.strip() for g in args.groups.split(",")]
        _positive_int(args.round, "--round", "e.g. --round 20")
        if args.devices is not None:
            _positive_int(args.devices, "--devices", "e.g. --devices 8")
    except ValueError as err:
        parser.error(str(err))
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error(f"--plot {args.plot} needs matplotlib: `pip install matplotlib`.")
    if args.devices is not None:
        jax.config.update("jax_num_cpu_devices", args.devices)
    set_log_level(args.log_level)
    initialize_distributed(PaddleCloudRoleMaker(is_collective=True))
    try:
        mesh = default_mesh(jax.device_count(), groups) if args.mesh is None else args.mesh
        hcg = build_hybrid_communicate_group(mesh)
        results = sweep(hcg, args.ops, groups, sizes, round=args.round)
    except ValueError as err:
        parser.error(str(err))
    if jax.process_index() == 0:
        shape = dict(hcg.mesh.shape)
        print(
            f"collective_perf: {jax.process_count()} process(es), {hcg.mesh.size} "
            f"{hcg.mesh.devices.flat[0].platform} devices, mesh {shape}, round {args.round}"
        )
        skipped = [g for g in groups if group_of(hcg, g).nranks < 2]
        if skipped:
            print(f"skipped (groups of 1 rank on this mesh): {', '.join(skipped)}")
        print(format_table(results), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"mesh": shape, "processes": jax.process_count(),
                           "results": [r.to_dict() for r in results]}, f, indent=1)  # fmt: skip
        if args.plot:
            plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
