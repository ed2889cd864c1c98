"""Tools for testing and measuring jfleet runs: HLO collective counts, reference runs, fixtures.

* :mod:`~jfleet.testing.hlo`: the collectives of a compiled program and their bytes.
* :mod:`~jfleet.testing.reference`: the same training on one device, to compare with.
* :mod:`~jfleet.testing.fleet_setup`: a strategy from keyword degrees, ``fleet.init`` on it.
"""
