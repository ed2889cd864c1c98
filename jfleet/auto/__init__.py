"""Auto-parallel analysis: find a model's parts, predict every layout, choose a plan.

* :mod:`jfleet.auto.patterns` — :func:`match_patterns` finds embeddings, attention
  (q/k/v/o or fused qkv, grouped-query heads), MLPs (SwiGLU, GELU), norms, the LM head
  and the repeated decoder blocks of an unannotated Flax NNX model, and gives each
  parameter its Megatron tensor-parallel role.
* :mod:`jfleet.auto.cost_model` — per-device memory, collective bytes and step time of
  every ``dp x pp x sharding x sep x mp`` layout the shapes allow.
* :mod:`jfleet.auto.profiles` — hardware profiles (emulated CPU, A100, H100, H200, or
  your own numbers).
* :mod:`jfleet.auto.plan` — :func:`plan_for` and the :class:`Plan` it returns.

Example:
  >>> from jfleet.auto import plan_for
  >>> from jfleet.models_llama import TinyLlama
  >>> plan = plan_for(TinyLlama(), device_num=8, batch_size=64, seq_len=8)
  >>> plan.layout.name
  'dp8'
"""

from jfleet.auto.cost_model import Candidate as Candidate
from jfleet.auto.cost_model import Layout as Layout
from jfleet.auto.cost_model import Workload as Workload
from jfleet.auto.cost_model import enumerate_layouts as enumerate_layouts
from jfleet.auto.cost_model import estimate as estimate
from jfleet.auto.cost_model import rank as rank
from jfleet.auto.patterns import ModelDims as ModelDims
from jfleet.auto.patterns import ModelPatterns as ModelPatterns
from jfleet.auto.patterns import ParamInfo as ParamInfo
from jfleet.auto.patterns import match_patterns as match_patterns
from jfleet.auto.plan import ParamPlan as ParamPlan
from jfleet.auto.plan import Plan as Plan
from jfleet.auto.plan import plan_for as plan_for
from jfleet.auto.plan import split_devices as split_devices
from jfleet.auto.profiles import PROFILES as PROFILES
from jfleet.auto.profiles import HardwareProfile as HardwareProfile
from jfleet.auto.profiles import get_profile as get_profile
