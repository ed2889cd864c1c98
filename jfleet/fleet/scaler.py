"""Paddle's ``paddle.distributed.fleet.scaler``: ``distributed_scaler``.

Example:
  >>> from jfleet.precision.amp import GradScaler
  >>> distributed_scaler(GradScaler(init_loss_scaling=8.0)).get_loss_scaling()
  8.0
"""

from jfleet.precision.grad_scaler import distributed_scaler as distributed_scaler

__all__ = ["distributed_scaler"]
