"""The test suite's time, file by file: wall seconds per file, and the whole run's CPU.

Runs the README's test command's pytest (``python -m pytest -q -n 2 --dist loadfile``: two
workers, so the files' seconds add up to more than the wall time) once with a JUnit
report, or reads reports already written, and writes the per-file table to ``benchmarks/RESULTS.md``
(section ``suite_time``): each file's summed test seconds (setup, call and teardown, module
fixtures included), its share of the run, and, given an earlier report (``--before``), the
same file's seconds there and the ratio.

Run it on an idle machine: on 2 cores another job doubles every number.

Example::

    python benchmarks/suite_time.py                           # run the suite, write the table
    python benchmarks/suite_time.py --before old.xml          # ... and compare with old.xml
    python benchmarks/suite_time.py --junit new.xml --before old.xml --wall 1180 --cpu 1250
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_file import write_section  # noqa: E402

SECTION = "suite_time"
VERSIONS = ("jax", "jaxlib", "flax", "optax", "numpy", "pytest", "pytest-xdist")


def per_file(junit: Path) -> dict[str, float]:
    """``{test file: seconds}`` from a JUnit report (doctests by their module's file)."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("classname", "")
        path = name.replace(".", "/")
        while path and not (ROOT / f"{path}.py").exists():  # strip class / doctest names
            path = path.rpartition("/")[0]
        seconds[f"{path}.py" if path else name] += float(case.get("time", 0.0))
    return dict(seconds)


def run_suite(junit: Path) -> tuple[float, float, int]:
    """Runs the suite with a JUnit report: (wall s, CPU s of it and its children, exit code)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile"]
    cmd += ["-p", "no:cacheprovider", f"--junitxml={junit}"]
    code = subprocess.run(cmd, cwd=ROOT).returncode
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, code


def table(now: dict[str, float], before: dict[str, float] | None, top: int) -> list[str]:
    """The Markdown rows, slowest file first (the rest summed in one row)."""
    total = sum(now.values())
    head = "| file | seconds | share |" + (" before | now / before |" if before else "")
    rule = "|---|---|---|" + ("---|---|" if before else "")
    rows = [head, rule]
    ranked = sorted(now.items(), key=lambda kv: -kv[1])
    for name, sec in ranked[:top]:
        row = f"| `{name}` | {sec:.1f} | {sec / total:.1%} |"
        if before:
            was = before.get(name)
            row += f" {was:.1f} | {sec / was:.2f} |" if was else " (new) | |"
        rows.append(row)
    rest = ranked[top:]
    if rest:
        sec = sum(s for _, s in rest)
        row = f"| {len(rest)} other files | {sec:.1f} | {sec / total:.1%} |"
        if before:
            was = sum(before.get(n, 0.0) for n, _ in rest)
            row += f" {was:.1f} | {sec / was:.2f} |" if was else " | |"
        rows.append(row)
    row = f"| **all tests** | **{total:.1f}** | 100% |"
    if before:
        was = sum(before.values())
        row += f" {was:.1f} | {total / was:.2f} |"
    rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--junit", type=Path, help="read this report instead of running")
    parser.add_argument("--before", type=Path, help="an earlier report to compare with")
    parser.add_argument("--wall", type=float, help="the run's wall seconds (with --junit)")
    parser.add_argument("--cpu", type=float, help="the run's CPU seconds (with --junit)")
    parser.add_argument("--top", type=int, default=40, help="files listed one by one")
    parser.add_argument("--note", default="", help="a line said under the table")
    parser.add_argument("--out", type=Path, help="write here instead of benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    wall, cpu, code = args.wall, args.cpu, None
    junit = args.junit
    if junit is None:
        junit = Path(tempfile.mkdtemp()) / "suite.xml"
        wall, cpu, code = run_suite(junit)
    now = per_file(junit)
    before = per_file(args.before) if args.before else None
    counts = ET.parse(junit).getroot().find("testsuite")
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    versions = ", ".join(f"{n} {metadata.version(n)}" for n in VERSIONS)
    lines = [
        "## The test suite, file by file",
        "",
        "- command: `python benchmarks/suite_time.py"
        + (f" --before {args.before.name}" if args.before else "")
        + "` (pytest -q with a JUnit report)",
        f"- date: {stamp}",
        f"- versions: {versions}, Python {platform.python_version()}",
        f"- machine: {platform.machine()}, nproc {os.cpu_count()}",
        f"- tests: {counts.get('tests')} ({counts.get('failures')} failed, "
        f"{counts.get('errors')} errors, {counts.get('skipped')} skipped)"
        + (f"; pytest exit code {code}" if code is not None else ""),
    ]
    if wall is not None:
        lines.append(
            f"- whole run: {wall:.0f} s wall"
            + (f", {cpu:.0f} CPU-seconds (the run and its children)" if cpu else "")
        )
    lines += ["", *table(now, before, args.top)]
    if args.note:
        lines += ["", args.note]
    body = "\n".join(lines)
    print(body)
    write_section(SECTION, body, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
