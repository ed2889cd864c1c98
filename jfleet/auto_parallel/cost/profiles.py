"""Hardware profiles for the cost model: peak flops, device memory, link bandwidths.

A :class:`HardwareProfile` is what :mod:`jfleet.auto_parallel.cost.cost_model` needs to know about a
machine. Nothing is measured at import; the numbers are vendors' public specifications
(dense, i.e. without structured sparsity) or, for the emulated CPU devices, small honest
guesses. Bandwidths are bytes per second *per device, in one direction*: the rate at
which a ring collective moves one device's share (NVLink's "900 GB/s" is the sum of both
directions, so 450e9 here).

Built-in profiles (:data:`PROFILES`):

* ``cpu`` (default): the host's CPU emulating devices (``jax_num_cpu_devices``). Eight
  devices share a few cores (``shared_cores``: a pipeline bubble costs no time): 40
  GFLOP/s matmul peak per device (2 AVX-512 cores' ~380 GFLOP/s fp32 shared by 8); the
  rest are effective rates, fitted to the measured CPU time of every ``to_distributed``
  candidate of the Llama example at width 64 (``benchmarks/planner_ranking.py``; width
  128 held out): collectives move 100 MB/s per device and pay 100 us each (the
  devices' threads meet at every collective, and a waiting thread spins on a shared
  core), a pipeline's loop traffic (dynamic-slice / update / copy) 200 MB/s; between
  processes (gloo over TCP) a quarter of in-process (a guess, not fitted); 2 GiB of
  (host) memory each. XLA:CPU has no reduce-scatter pass (a sharded gradient reduction is
  an all-reduce followed by a slice: ``reduce_scatter_native=False``, see
  :mod:`jfleet.testing.hlo`).
* ``a100``: NVIDIA A100 SXM4 80GB (A100 datasheet): 19.5 TFLOP/s fp32, 156 TF32, 312
  bf16/fp16; 80 GB HBM2e at 2,039 GB/s; NVLink 3 600 GB/s total (300e9 per direction); HDR
  InfiniBand 200 Gb/s per GPU between nodes (DGX A100: 25e9 B/s).
* ``a100-40gb``: NVIDIA A100 SXM4 40GB (A100 datasheet): as ``a100`` with 40 GB HBM2 at
  1,555 GB/s.
* ``h100``: NVIDIA H100 SXM5 80GB (H100 datasheet): 67 TFLOP/s fp32, 494.7 TF32, 989.4
  bf16/fp16 and 1,978.9 fp8 dense; 80 GB HBM3 at 3.35 TB/s; NVLink 4 900 GB/s total (450e9 per
  direction); NDR 400 Gb/s per GPU between nodes (DGX H100: 50e9 B/s).
* ``h200``: NVIDIA H200 SXM 141GB (H200 datasheet): the H100's compute, 141 GB HBM3e at
  4.8 TB/s, NVLink 900 GB/s, 400 Gb/s per GPU between nodes.

Beyond the datasheets the GPU profiles reach ``matmul_efficiency`` of peak in large
matmuls (0.5 on the A100s; 0.45 on the H100 / H200, see ``benchmarks/published_fsdp.py``),
hide the gradient reduction and ZeRO gathers under the compute the schedule leaves beside
them (``comm_overlap``), reduce-scatter gradients as they are produced
(``whole_grad_temp=False``) and keep 5% of memory for the allocator (``memory_margin``);
the emulated ``cpu`` profile keeps the terms measured on XLA:CPU (the loops' memory
traffic, whole local gradients, no overlap).

``platform`` says what the devices are (``cpu`` for the emulated profile, ``gpu`` for the
others and by default): the reference models' attention
(:func:`jfleet.models.attention.causal_attention`) runs cuDNN's flash attention on a GPU
for half inputs with a head dimension up to ``flash_max_head_dim`` (128 on the A100s, 256
on the Hopper ``h100`` / ``h200``), so a plan for a GPU profile keeps no ``s x s`` scores
(:func:`jfleet.auto_parallel.match.attention_trace.attention_as_run`).

``float32`` on the GPU profiles is the TF32 tensor-core rate: with JAX's default matmul
precision XLA runs float32 matmuls in TF32 on these GPUs. ``float32_highest`` is the
full-precision rate (``jax_default_matmul_precision="highest"``).

Example:
  >>> get_profile("h100").flops("bfloat16") / 1e12
  989.4
  >>> custom = HardwareProfile(
  ...     name="my-gpu", peak_flops={"float32": 50e12}, memory_bytes=24 * 2**30,
  ...     intra_node_bandwidth=64e9, inter_node_bandwidth=12.5e9, devices_per_node=4)
  >>> custom.flops("float32") == 50e12
  True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["PROFILES", "HardwareProfile", "get_profile"]

GiB = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """What the cost model needs to know about one kind of machine.

    Attributes:
      name: a label for the plan's table.
      peak_flops: peak matmul flop/s of one device per dtype name (``float32``,
        ``bfloat16``, ``float16``, ...). A mapping is accepted and stored as sorted
        ``(dtype, flops)`` pairs so the profile stays hashable.
      memory_bytes: memory per device (the default memory budget).
      intra_node_bandwidth: bytes/s per device, one direction, inside a node.
      inter_node_bandwidth: bytes/s per device, one direction, between nodes.
      devices_per_node: devices in one node (used when ``device_num`` is not given).
      collective_latency: seconds each collective costs on top of its bytes.
      reduce_scatter_native: whether the compiler emits a reduce-scatter for a sharded
        gradient reduction (GPU, TPU) or an all-reduce plus a slice (XLA:CPU).
      remat_barriers_kept: whether the compiler keeps ``jax.checkpoint``'s optimization
        barriers until it has scheduled the step (XLA:GPU, TPU), so recompute outside a
        loop saves memory; XLA:CPU removes them before scheduling and runs the
        recomputation with the forward pass (:mod:`jfleet.recompute`), so there only
        recompute inside a loop (scanned or pipelined blocks) saves memory.
      shared_cores: whether the devices share the host's cores (emulated CPU devices): a
        device idle in a pipeline bubble leaves its core to the others, so bubbles cost
        no step time.
      memory_bandwidth: bytes/s one device's memory moves for the step's loops (the
        residuals a pipeline or a scan over layers stashes and fetches with
        dynamic-update-slice / dynamic-slice / copy); default: 7x the intra-node link (HBM
        over NVLink on A100 and H100).
      loop_traffic: whether the pipeline loops' memory traffic is charged as step time
        (fitted on XLA:CPU, where it bounds pipelined steps; on the GPU profiles it hides
        under the matmuls and is not charged).
      matmul_efficiency: the fraction of ``peak_flops`` a large matmul reaches (cuBLAS on
        a GEMM of a transformer's shapes); the step's compute runs at this x the roofline
        below.
      roofline: whether a micro-batch's matmuls are charged by the roofline (a weight of
        ``k x n`` applied to ``m`` rows moves ``(mk + kn + mn)`` elements for ``2 mkn``
        flops: below ``peak / memory_bandwidth`` flops per byte it is memory-bound).
      comm_overlap: the fraction of the data-parallel reduction (and of ZeRO-3's
        gathers) that runs under the compute the schedule leaves beside it (the backward
        of the last micro-batch in a pipeline, the whole backward without one; the forward
        too for the gathers); 0 charges every byte.
      whole_grad_temp: whether the step materialises each device's whole local gradient
        beside the reduction's output at the end of the backward (XLA:CPU, measured; ZeRO-2
        saves nothing there). Else the gradients are reduce-scattered as they are produced
        and only the ZeRO shard (and one block's in flight) stays live.
      memory_margin: the fraction of ``memory_bytes`` kept out of the default budget for
        the allocator's fragmentation and the runtime's own buffers.
      half_precision_fp32: whether the compiler runs bf16 / fp16 matmuls and collectives
        in fp32 (XLA:CPU's float normalization upcasts them: measured on an AMP O2 step,
        every dot and every collective is f32), so activations are fp32-sized and
        half-precision parameters' gradients are reduced and gathered at 4 bytes an
        element. On GPUs and TPUs they run in their own dtype.
      platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``: what the devices run, for the choices a
        program makes by platform (:func:`jfleet.models.attention.causal_attention` runs
        cuDNN flash attention on a GPU, so a reference model planned for one keeps no
        ``s x s`` scores).
      flash_max_head_dim: the largest head dimension the GPU's flash attention kernel
        takes (cuDNN: 128 before Hopper, 256 from Hopper on).

    Raises:
      ValueError: a non-positive number, no flops given, or an unknown ``platform``.

    Example:
      >>> from jfleet.auto_parallel import get_profile
      >>> isinstance(get_profile("h100"), HardwareProfile), get_profile("h100").name
      (True, 'h100')
    """

    name: str
    peak_flops: Any
    memory_bytes: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    devices_per_node: int = 8
    collective_latency: float = 1e-5
    reduce_scatter_native: bool = True
    remat_barriers_kept: bool = True
    shared_cores: bool = False
    memory_bandwidth: float | None = None
    loop_traffic: bool = True
    matmul_efficiency: float = 1.0
    roofline: bool = False
    comm_overlap: float = 0.0
    whole_grad_temp: bool = True
    memory_margin: float = 0.0
    half_precision_fp32: bool = False
    platform: str = "gpu"
    flash_max_head_dim: int = 256

    def __post_init__(self) -> None:
        if self.platform not in ("cpu", "gpu", "tpu"):
            raise ValueError(
                f"profile {self.name!r}: platform={self.platform!r}; expected 'cpu', 'gpu' "
                "or 'tpu' (what its devices are)."
            )
        flops = self.peak_flops
        if isinstance(flops, Mapping):
            flops = tuple(sorted((str(k), float(v)) for k, v in flops.items()))
        else:
            flops = tuple((str(k), float(v)) for k, v in flops)
        if not flops:
            raise ValueError(
                f"profile {self.name!r}: peak_flops is empty; give e.g. {{'float32': 1e12}}."
            )
        object.__setattr__(self, "peak_flops", flops)
        bad = {k: v for k, v in flops if not v > 0}
        if self.memory_bandwidth is None:
            object.__setattr__(self, "memory_bandwidth", 7 * self.intra_node_bandwidth)
        for field in (
            "memory_bytes",
            "intra_node_bandwidth",
            "inter_node_bandwidth",
            "memory_bandwidth",
        ):
            if not getattr(self, field) > 0:
                bad[field] = getattr(self, field)
        if not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
            bad["devices_per_node"] = self.devices_per_node
        if self.collective_latency < 0:
            bad["collective_latency"] = self.collective_latency
        if not 0 < self.matmul_efficiency <= 1:
            bad["matmul_efficiency"] = self.matmul_efficiency
        if not 0 <= self.comm_overlap <= 1:
            bad["comm_overlap"] = self.comm_overlap
        if not 0 <= self.memory_margin < 1:
            bad["memory_margin"] = self.memory_margin
        if not isinstance(self.flash_max_head_dim, int) or self.flash_max_head_dim < 1:
            bad["flash_max_head_dim"] = self.flash_max_head_dim
        if bad:
            raise ValueError(
                f"profile {self.name!r}: {bad} must be positive (latency >= 0, "
                "devices_per_node and flash_max_head_dim ints >= 1, matmul_efficiency in "
                "(0, 1], comm_overlap in [0, 1], memory_margin in [0, 1))."
            )

    def flops(self, dtype: str) -> float:
        """Peak flop/s for matmuls in ``dtype``; falls back to ``float32``, then the slowest.

        Args:
          dtype: a dtype name such as ``"float32"`` or ``"bfloat16"``.
        """
        table = dict(self.peak_flops)
        if str(dtype) in table:
            return table[str(dtype)]
        if "float32" in table:
            return table["float32"]
        return min(table.values())

    @property
    def usable_memory(self) -> float:
        """The default memory budget: ``memory_bytes`` less the allocator margin."""
        return self.memory_bytes * (1 - self.memory_margin)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``HardwareProfile(**d)`` rebuilds it)."""
        out = dataclasses.asdict(self)
        out["peak_flops"] = dict(self.peak_flops)
        return out


_CPU = HardwareProfile(
    name="cpu",
    peak_flops={"float32": 40e9, "bfloat16": 20e9, "float16": 20e9},
    memory_bytes=2 * GiB,
    intra_node_bandwidth=100e6,
    inter_node_bandwidth=25e6,
    devices_per_node=8,
    collective_latency=100e-6,
    reduce_scatter_native=False,
    remat_barriers_kept=False,
    shared_cores=True,
    memory_bandwidth=200e6,
    half_precision_fp32=True,
    platform="cpu",
)
#: What the GPU profiles share beyond their datasheets: the achievable matmul fraction (fitted
#: on the calibration rows of ``benchmarks/published_configs.py``, see there), the overlap
#: of the gradient reduction / ZeRO gathers with compute, gradients reduce-scattered as
#: they are produced, and 5% of memory kept for the allocator (run JAX with
#: ``XLA_PYTHON_CLIENT_MEM_FRACTION=.95``: by default it preallocates 75%).
_GPU = {
    "loop_traffic": False,
    "matmul_efficiency": 0.5,
    "roofline": True,
    "comm_overlap": 1.0,
    "whole_grad_temp": False,
    "memory_margin": 0.05,
}
_A100 = HardwareProfile(
    name="a100",
    peak_flops={
        "float32": 156e12,
        "float32_highest": 19.5e12,
        "bfloat16": 312e12,
        "float16": 312e12,
    },
    memory_bytes=80 * 10**9,
    intra_node_bandwidth=300e9,
    inter_node_bandwidth=25e9,
    devices_per_node=8,
    memory_bandwidth=2.039e12,
    flash_max_head_dim=128,  # Ampere: cuDNN's flash attention takes head_dim <= 128
    **_GPU,
)
_A100_40 = dataclasses.replace(
    _A100, name="a100-40gb", memory_bytes=40 * 10**9, memory_bandwidth=1.555e12
)
_H100 = HardwareProfile(
    name="h100",
    peak_flops={
        "float32": 494.7e12,
        "float32_highest": 67e12,
        "bfloat16": 989.4e12,
        "float16": 989.4e12,
        "float8_e4m3fn": 1978.9e12,
        "float8_e5m2": 1978.9e12,
    },
    memory_bytes=80 * 10**9,
    intra_node_bandwidth=450e9,
    inter_node_bandwidth=50e9,
    devices_per_node=8,
    memory_bandwidth=3.35e12,
    **{
        **_GPU,
        # Hopper's matmul peak grew 3.2x over Ampere's, its memory bandwidth 1.6x: the
        # step's other work (attention, norms, elementwise) costs more of it. Fitted on
        # the held-in H100 rows of benchmarks/published_fsdp.py (MosaicML's FSDP runs at
        # 40-43% MFU, 51-57% with full recompute counted); A100 stays at SC21's 0.5.
        "matmul_efficiency": 0.45,
    },
)
_H200 = dataclasses.replace(_H100, name="h200", memory_bytes=141 * 10**9, memory_bandwidth=4.8e12)


class Profiles(dict):
    """The built-in hardware profiles by name: a ``dict`` of :class:`HardwareProfile`.

    ``cpu``, ``a100`` (= ``a100-80gb``), ``a100-40gb``, ``h100`` and ``h200``; add your own
    with ``PROFILES["mine"] = dataclasses.replace(PROFILES["h100"], name="mine", ...)``.

    Example:
      >>> sorted(PROFILES)
      ['a100', 'a100-40gb', 'a100-80gb', 'cpu', 'h100', 'h200']
      >>> PROFILES["h100"].memory_bytes / 1e9
      80.0
    """


#: The built-in profiles by name.
PROFILES: Profiles = Profiles({p.name: p for p in (_CPU, _A100, _A100_40, _H100, _H200)})
PROFILES["a100-80gb"] = _A100


def get_profile(profile: str | HardwareProfile | None = None) -> HardwareProfile:
    """A profile by name (``cpu``, ``a100`` = ``a100-80gb``, ``a100-40gb``, ``h100``,
    ``h200``), or ``profile`` itself.

    Args:
      profile: a name, a :class:`HardwareProfile`, or None for ``cpu``.

    Raises:
      ValueError: an unknown name.
      TypeError: neither a name nor a profile.

    Example:
      >>> get_profile("h100").name
      'h100'
    """
    if profile is None:
        return _CPU
    if isinstance(profile, HardwareProfile):
        return profile
    if isinstance(profile, str):
        key = profile.lower()
        if key not in PROFILES:
            raise ValueError(
                f"profile={profile!r} is not a known profile; use one of {sorted(PROFILES)} "
                "or pass a HardwareProfile(...)."
            )
        return PROFILES[key]
    raise TypeError(
        f"profile={profile!r} ({type(profile).__name__}) is neither a profile name nor a "
        "HardwareProfile."
    )
