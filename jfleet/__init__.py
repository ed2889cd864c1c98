"""jfleet: PaddlePaddle Fleet's distributed-training API as SPMD on JAX and Flax NNX."""
