"""Auto-parallel analysis: find a model's parts, predict every layout, choose a plan.

The auto-parallel layer (``to_distributed``), above training: it plans and applies a
run.

May import: runtime, mesh, optim, parallel, models, precision, training.

* :mod:`jfleet.auto_parallel.dataflow` — :func:`trace_model` traces one forward call
  abstractly and follows every parameter through it: which projection's output dimension
  reaches which projection's contracted dimension, and every product's FLOPs.
* :mod:`jfleet.auto_parallel.patterns` — :func:`match_patterns` reads from that trace the
  Megatron column / row pairs (attention of any kernel rank or einsum, grouped-query
  heads, MLPs gated or not), and finds embeddings, norms, the LM head and the repeated
  decoder blocks of an unannotated Flax NNX model.
* :mod:`jfleet.auto_parallel.layouts` — every ``dp x pp x sharding x sep x mp`` layout the
  shapes allow (with ZeRO stage, schedule, micro-batches, recompute), and why the other
  meshes are excluded.
* :mod:`jfleet.auto_parallel.cost_model` — per-device memory, collective bytes and step time
  of a layout; the ranking.
* :mod:`jfleet.auto_parallel.profiles` — hardware profiles (emulated CPU, A100, H100, H200, or
  your own numbers).
* :mod:`jfleet.auto_parallel.plan` — the :class:`Plan` (data, table, JSON).
* :mod:`jfleet.auto_parallel.planner` — :func:`plan_for` chooses it.
* :mod:`jfleet.auto_parallel.to_distributed` — :func:`to_distributed` applies a plan to a
  model, optimizer and loader; :func:`get_plan` gives it back.
* :mod:`jfleet.auto_parallel.blocks` — the pipelined stand-in for a list of blocks.

The loader ``to_distributed`` returns, yielding global sharded batches, is
:class:`jfleet.data.ShardedLoader`.

Example:
  >>> from jfleet.auto_parallel import plan_for
  >>> from jfleet.models.llama import TinyLlama
  >>> plan = plan_for(TinyLlama(), device_num=8, batch_size=64, seq_len=8)
  >>> plan.layout.name
  'dp8'
"""

from jfleet.auto_parallel.cost_model import Candidate as Candidate
from jfleet.auto_parallel.cost_model import estimate as estimate
from jfleet.auto_parallel.cost_model import rank as rank
from jfleet.auto_parallel.dataflow import TraceError as TraceError
from jfleet.auto_parallel.dataflow import trace_model as trace_model
from jfleet.auto_parallel.layouts import Layout as Layout
from jfleet.auto_parallel.layouts import Workload as Workload
from jfleet.auto_parallel.layouts import enumerate_layouts as enumerate_layouts
from jfleet.auto_parallel.patterns import ModelDims as ModelDims
from jfleet.auto_parallel.patterns import ModelPatterns as ModelPatterns
from jfleet.auto_parallel.patterns import ParamInfo as ParamInfo
from jfleet.auto_parallel.patterns import match_patterns as match_patterns
from jfleet.auto_parallel.plan import ParamPlan as ParamPlan
from jfleet.auto_parallel.plan import Plan as Plan
from jfleet.auto_parallel.plan import split_devices as split_devices
from jfleet.auto_parallel.planner import plan_for as plan_for
from jfleet.auto_parallel.profiles import PROFILES as PROFILES
from jfleet.auto_parallel.profiles import HardwareProfile as HardwareProfile
from jfleet.auto_parallel.profiles import get_profile as get_profile
from jfleet.auto_parallel.to_distributed import ToDistributedConfig as ToDistributedConfig
from jfleet.auto_parallel.to_distributed import get_plan as get_plan
from jfleet.auto_parallel.to_distributed import to_distributed as to_distributed
