"""Tensor-, sequence- and (later) pipeline-parallel building blocks on the fleet's mesh."""
