"""Tests of jfleet.auto_parallel: patterns, cost model, plan."""
