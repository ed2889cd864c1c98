"""Tests of jfleet.auto: patterns, cost model, plan."""
