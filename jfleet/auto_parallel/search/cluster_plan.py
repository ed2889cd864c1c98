"""Plan a cluster you are not on: an abstract model, a batch shape and a cluster description.

:func:`plan` needs no devices: the model may be abstract (``nnx.eval_shape``), the cluster
is a :class:`Cluster` (nodes x devices per node, a hardware profile, optionally the memory
per device), and the search is the wide one practitioners use (every micro-batch count,
virtual stages, gradient accumulation, ZeRO 0-3, full or selective recompute; dominated
layouts pruned). The result is the same :class:`~jfleet.auto_parallel.search.plan.Plan`
``to_distributed`` prints. The command line plans a named or given shape::

    python -m jfleet.auto_parallel.cluster_plan llama2-70b --nodes 8 --profile h100
    python -m jfleet.auto_parallel.cluster_plan --arch llama --layers 32 --width 4096 \\
        --heads 32 --kv-heads 8 --ffn 14336 --vocab 128256 --seq 8192 --batch 512 \\
        --nodes 4 --profile h200
    python -m jfleet.auto_parallel.cluster_plan llama3-8b --batch 128 --sequence-parallel \
        --amp-level O2 --distributed-optimizer

The reference models' attention is :func:`jfleet.models.attention.causal_attention`, which
runs cuDNN's flash attention on a GPU (bf16 / fp16, head dimension a multiple of 8 up to
the profile's ``flash_max_head_dim``), as every published run at 4k-8k tokens does: on a
GPU profile the plan keeps no ``s x s`` scores and says so in its notes.
``--materialised-attention`` (``plan(..., materialised_attention=True)``) charges the
scores XLA's implementation keeps instead; the ``cpu`` profile always does (XLA:CPU runs
that implementation).

Example:
  >>> from jfleet.auto_parallel.search.model_shapes import ModelShape, abstract_model
  >>> shape = ModelShape(arch="llama", layers=4, width=256, heads=8, kv_heads=8, ffn=512,
  ...                    vocab=1024, seq_len=256)
  >>> p = plan(abstract_model(shape), batch=(64, 256), cluster=Cluster(nodes=2, profile="h100"))
  >>> p.device_num, p.node_num, p.dtype
  (8, 2, 'bfloat16')
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

from flax import nnx

from jfleet.auto_parallel.cost.profiles import PROFILES, HardwareProfile, get_profile
from jfleet.auto_parallel.search.model_shapes import MODEL_SHAPES, ModelShape, abstract_model
from jfleet.auto_parallel.search.plan import Plan
from jfleet.auto_parallel.search.planner import plan_for

__all__ = ["Cluster", "main", "plan"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    """The machines a plan is for.

    Attributes:
      nodes: how many nodes.
      devices_per_node: accelerators per node (tensor parallelism stays inside one).
      profile: a :mod:`~jfleet.auto_parallel.cost.profiles` name or a ``HardwareProfile``.
      memory_bytes: memory budget per device; default the profile's usable memory.
    """

    nodes: int = 1
    devices_per_node: int = 8
    profile: str | HardwareProfile = "h100"
    memory_bytes: float | None = None

    def __post_init__(self) -> None:
        for f in ("nodes", "devices_per_node"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Cluster({f}={value!r}): expected an int >= 1.")
        get_profile(self.profile)  # an unknown name fails here, naming the known ones

    @property
    def devices(self) -> int:
        """All devices."""
        return self.nodes * self.devices_per_node


def plan(
    model: nnx.Module,
    batch: tuple[int, int],
    cluster: Cluster,
    *,
    dtype: str = "bfloat16",
    amp_level: str = "O1",
    wide_search: bool = True,
    materialised_attention: bool = False,
    **options: Any,
) -> Plan:
    """The fastest layout of ``model`` that fits ``cluster``, planned without its devices.

    Args:
      model: an ``nnx.Module``, abstract (``nnx.eval_shape(lambda: Model(...))``) or not.
      batch: ``(global batch in sequences, sequence length)``.
      cluster: the :class:`Cluster`.
      dtype: the compute dtype (the AMP dtype).
      amp_level: ``"O1"``: the parameters keep their own dtype (fp32 for
        :func:`~jfleet.auto_parallel.search.model_shapes.abstract_model`); ``"O2"``: they
        are stored in ``dtype``, norms aside, with fp32 master weights beside the
        moments (``plan_for``'s ``amp_level``). With ``distributed_optimizer=True`` (a
        ``plan_for`` option) that is Megatron's distributed optimizer.
      wide_search: the practitioners' search (``plan_for``'s ``wide_search``).
      materialised_attention: charge the ``s x s`` attention scores even where the
        model's attention runs fused on the cluster's platform (see the module docstring;
        ``plan_for``'s ``materialised_attention``). Default: fused where it runs fused.
      **options: further :func:`~jfleet.auto_parallel.search.planner.plan_for` arguments
        (``force_mesh``, ``zero_stage``, ``sequence_parallel``, ``optimizer``, ...).

    Returns:
      The :class:`~jfleet.auto_parallel.search.plan.Plan`; ``print`` it for the table.

    Raises:
      ValueError: a batch that is not two positive ints, or what ``plan_for`` raises
        (e.g. no layout fits).
    """
    if (
        not isinstance(batch, Sequence)
        or len(batch) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in batch)
    ):
        raise ValueError(f"batch={batch!r}: expected (global batch, sequence length) ints >= 1.")
    return plan_for(
        model,
        device_num=cluster.devices_per_node,
        node_num=cluster.nodes,
        batch_size=batch[0],
        seq_len=batch[1],
        profile=cluster.profile,
        memory_budget=cluster.memory_bytes,
        dtype=dtype,
        amp_level=amp_level,
        wide_search=wide_search,
        materialised_attention=materialised_attention,
        **options,
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jfleet.auto_parallel.cluster_plan",
        description="Plan a named or given model shape on a cluster, without its devices.",
    )
    p.add_argument("model", nargs="?", choices=sorted(MODEL_SHAPES), help="a named shape")
    for name in ("layers", "width", "heads", "kv-heads", "ffn", "vocab", "seq"):
        p.add_argument(f"--{name}", type=int, help=f"{name} (overrides the named shape's)")
    p.add_argument("--arch", choices=("llama", "gpt"), help="llama or gpt")
    p.add_argument("--batch", type=int, default=1024, help="global batch in sequences")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--devices-per-node", type=int, default=8)
    p.add_argument("--profile", default="h100", choices=sorted(PROFILES))
    p.add_argument("--memory-gib", type=float, help="memory budget per device, GiB")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--amp-level",
        default="O1",
        choices=("O1", "O2"),
        help="O2: parameters stored in --dtype with fp32 master weights (default O1: fp32)",
    )
    p.add_argument(
        "--distributed-optimizer",
        action="store_const",
        const=True,
        help="only ZeRO over every data rank, dp x sharding x sep (Megatron's distributed "
        "optimizer); default: compared with ZeRO over sharding",
    )
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument(
        "--materialised-attention",
        action="store_true",
        help="charge the s x s attention scores (XLA's attention) instead of the flash "
        "attention the reference models run on a GPU profile",
    )
    return p


def _shape(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ModelShape:
    given = {
        "arch": args.arch, "layers": args.layers, "width": args.width, "heads": args.heads,
        "kv_heads": args.kv_heads, "ffn": args.ffn, "vocab": args.vocab, "seq_len": args.seq,
    }  # fmt: skip
    given = {k: v for k, v in given.items() if v is not None}
    if args.model is not None:
        return dataclasses.replace(MODEL_SHAPES[args.model], **given)
    missing = [k for k in ("arch", "layers", "width", "heads", "ffn", "vocab", "seq_len")
               if k not in given]  # fmt: skip
    if missing:
        parser.error(f"no named model: give {missing} (or a name: {sorted(MODEL_SHAPES)})")
    given.setdefault("kv_heads", given["heads"])
    try:
        return ModelShape(**given)
    except ValueError as err:
        parser.error(str(err))


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring); prints the plan, returns 0."""
    parser = _parser()
    args = parser.parse_args(argv)
    shape = _shape(args, parser)
    memory = args.memory_gib * 2**30 if args.memory_gib else None
    cluster = Cluster(
        nodes=args.nodes,
        devices_per_node=args.devices_per_node,
        profile=args.profile,
        memory_bytes=memory,
    )
    start = time.perf_counter()
    model = abstract_model(shape)
    built = time.perf_counter()
    result = plan(
        model,
        (args.batch, shape.seq_len),
        cluster,
        dtype=args.dtype,
        amp_level=args.amp_level,
        distributed_optimizer=args.distributed_optimizer,
        sequence_parallel=args.sequence_parallel,
        materialised_attention=args.materialised_attention,
    )
    done = time.perf_counter()
    print(f"model: {args.model or 'given shape'}, {shape.params / 1e9:.1f}B parameters, {shape}")
    print(result)
    print(f"\nabstract model {built - start:.1f} s, planning {done - built:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
