"""Paddle Fleet meta-optimizers as Optax gradient transformations, and the strategy compiler.

The optim layer: each meta-optimizer is an ``optax.GradientTransformation`` factory;
``compiler`` turns a strategy's settings into one chain.

May import: runtime, mesh.

Example:
  >>> import optax
  >>> from jfleet import optim
  >>> tx = optim.gradient_merge(optim.dynamic_loss_scaling(optax.adam(1e-3)), k_steps=4)
"""

from jfleet.optim import hyperparams as hyperparams
from jfleet.optim import lr as lr
from jfleet.optim.clip import ClipGradByGlobalNorm as ClipGradByGlobalNorm
from jfleet.optim.clip import ClipGradByNorm as ClipGradByNorm
from jfleet.optim.clip import ClipGradByValue as ClipGradByValue
from jfleet.optim.clip import clip_by_global_norm as clip_by_global_norm
from jfleet.optim.clip import global_norm as global_norm
from jfleet.optim.communication import GradientCommunication as GradientCommunication
from jfleet.optim.communication import fp16_allreduce as fp16_allreduce
from jfleet.optim.communication import mean_communication as mean_communication
from jfleet.optim.gradient_merge import gradient_merge as gradient_merge
from jfleet.optim.lamb_lars import lamb_from as lamb_from
from jfleet.optim.lamb_lars import lars_from as lars_from
from jfleet.optim.localsgd import LocalSGDConfig as LocalSGDConfig
from jfleet.optim.localsgd import adaptive_k_steps as adaptive_k_steps
from jfleet.optim.loss_scale import dynamic_loss_scaling as dynamic_loss_scaling
from jfleet.optim.loss_scale import loss_scale_of as loss_scale_of
from jfleet.optim.master_weights import master_weights as master_weights
