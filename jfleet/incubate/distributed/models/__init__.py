"""``paddle.incubate.distributed.models``: the mixture-of-experts layer (:mod:`.moe`)."""

from __future__ import annotations

from jfleet.incubate.distributed.models import moe as moe

__all__ = ["moe"]
