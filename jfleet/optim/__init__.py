"""Paddle Fleet meta-optimizers as Optax gradient transformations."""
