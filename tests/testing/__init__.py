"""Tests of jfleet.testing: the HLO readers."""
