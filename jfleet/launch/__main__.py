"""``python -m jfleet.launch``: see :mod:`jfleet.launch`."""

from __future__ import annotations

import sys

from jfleet.launch import main

if __name__ == "__main__":
    sys.exit(main())
