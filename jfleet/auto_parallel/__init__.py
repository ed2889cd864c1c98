"""Auto-parallel analysis: find a model's parts, predict every layout, choose a plan.

The auto-parallel layer (``to_distributed``), above training: it plans and applies a
run.

May import: runtime, mesh, optim, parallel, models, precision, training.

Four stages, each a folder, each importing only the ones before it:

* :mod:`jfleet.auto_parallel.match` — trace one forward abstractly and find the model's
  parts: Megatron column / row pairs (attention of any kernel rank or einsum,
  grouped-query heads, MLPs gated or not), embeddings, norms, the LM head, the repeated
  decoder blocks and how they are called.
* :mod:`jfleet.auto_parallel.cost` — a layout (``dp x pp x sharding x sep x mp``, ZeRO
  stage, schedule, micro-batches, recompute) on a hardware profile: per-device memory,
  collective bytes and step time, term by term.
* :mod:`jfleet.auto_parallel.search` — every layout the shapes allow (and why the other
  meshes are out), ranked; the chosen :class:`Plan` (data, table, JSON).
* :mod:`jfleet.auto_parallel.apply` — the plan applied: pipelined or scanned stand-ins for
  the decoder blocks, recompute, sequence parallelism, placed parameters.

:mod:`jfleet.auto_parallel.to_distributed` calls them in that order (:func:`to_distributed`;
:func:`get_plan` gives the plan back); :mod:`jfleet.auto_parallel.config` holds its
options. The flat module paths of earlier releases (``jfleet.auto_parallel.patterns``)
still import, as aliases of the modules' homes.

The loader ``to_distributed`` returns, yielding global sharded batches, is
:class:`jfleet.data.ShardedLoader`.

Example:
  >>> from jfleet.auto_parallel import plan_for
  >>> from jfleet.models.llama import TinyLlama
  >>> plan = plan_for(TinyLlama(), device_num=8, batch_size=64, seq_len=8)
  >>> plan.layout.name
  'dp8'
"""

from jfleet.auto_parallel.cost.cost_model import Candidate as Candidate
from jfleet.auto_parallel.cost.cost_model import estimate as estimate
from jfleet.auto_parallel.cost.cost_model import rank as rank
from jfleet.auto_parallel.cost.layout import Layout as Layout
from jfleet.auto_parallel.cost.layout import Workload as Workload
from jfleet.auto_parallel.cost.profiles import PROFILES as PROFILES
from jfleet.auto_parallel.cost.profiles import HardwareProfile as HardwareProfile
from jfleet.auto_parallel.cost.profiles import get_profile as get_profile
from jfleet.auto_parallel.match.dataflow import TraceError as TraceError
from jfleet.auto_parallel.match.dataflow import trace_model as trace_model
from jfleet.auto_parallel.match.patterns import ModelDims as ModelDims
from jfleet.auto_parallel.match.patterns import ModelPatterns as ModelPatterns
from jfleet.auto_parallel.match.patterns import ParamInfo as ParamInfo
from jfleet.auto_parallel.match.patterns import match_patterns as match_patterns
from jfleet.auto_parallel.search.layouts import enumerate_layouts as enumerate_layouts
from jfleet.auto_parallel.search.plan import ParamPlan as ParamPlan
from jfleet.auto_parallel.search.plan import Plan as Plan
from jfleet.auto_parallel.search.plan import split_devices as split_devices
from jfleet.auto_parallel.search.planner import plan_for as plan_for
from jfleet.auto_parallel.to_distributed import ToDistributedConfig as ToDistributedConfig
from jfleet.auto_parallel.to_distributed import get_plan as get_plan
from jfleet.auto_parallel.to_distributed import to_distributed as to_distributed
