"""``paddle.incubate.distributed``: the ``models`` package (:mod:`.models.moe`)."""

from __future__ import annotations

from jfleet.incubate.distributed import models as models

__all__ = ["models"]
