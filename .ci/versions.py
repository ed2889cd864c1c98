"""The installed versions, as pip constraints: print them, compare them, or write them.

* ``python .ci/versions.py``: every installed distribution as ``name==version`` (jfleet and
  pip's own tools left out), sorted.
* ``python .ci/versions.py --diff .ci/constraints.txt``: only those that differ from the
  file (or are missing from it), each with the file's version.
* ``python .ci/versions.py --write .ci/constraints.txt``: the file anew, after a green run
  of the README's test command on the newest releases.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path

SKIP = {"jfleet", "pip", "setuptools", "wheel"}
HEADER = (
    "# The newest versions the README's test command last passed with (CI's suite installs\n"
    "# these: PIP_CONSTRAINT in .ci/run). Rewrite after a green run on newer releases:\n"
    "#   python .ci/versions.py --write .ci/constraints.txt\n"
)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    found = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and canonical(name) not in SKIP:
            found[canonical(name)] = dist.version
    return dict(sorted(found.items()))


def read(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[canonical(name)] = version.strip()
    return pins


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--diff", type=Path, metavar="FILE")
    group.add_argument("--write", type=Path, metavar="FILE")
    args = parser.parse_args(argv)
    now = installed()
    if args.write:
        args.write.write_text(HEADER + "".join(f"{n}=={v}\n" for n, v in now.items()))
        print(f"wrote {len(now)} versions to {args.write}")
    elif args.diff:
        pins = read(args.diff)
        other = {n: v for n, v in now.items() if pins.get(n) != v}
        for name, version in other.items():
            print(f"{name}=={version}  (constraints: {pins.get(name, 'not listed')})")
        if not other:
            print(f"(none: every version is the one in {args.diff})")
    else:
        print("\n".join(f"{n}=={v}" for n, v in now.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
