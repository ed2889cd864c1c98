"""A model with no transformer part: nothing for mp to split, no blocks to pipeline."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class ConvNet(nnx.Module):
    """A convolution, a mean over the pixels, a linear read-out."""

    def __init__(self) -> None:
        self.conv = nnx.Conv(1, 4, (3, 3), rngs=nnx.Rngs(0))
        self.out = nnx.Linear(4, 1, rngs=nnx.Rngs(1))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jnp.mean(self.conv(x), axis=(1, 2)))


#: Its parameters' paths.
CONV_NET_PATHS = {"conv.kernel", "conv.bias", "out.kernel", "out.bias"}
