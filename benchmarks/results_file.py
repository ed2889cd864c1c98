"""The one way a benchmark writes its table into ``benchmarks/RESULTS.md``.

Each benchmark owns a section between ``<!-- NAME: begin -->`` and ``<!-- NAME: end -->``
markers; rerunning one replaces its section and leaves the others as they are.
"""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path

import flax
import jax
import optax

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def markers(name: str) -> tuple[str, str]:
    """The begin and end markers of section ``name``."""
    return f"<!-- {name}: begin -->", f"<!-- {name}: end -->"


def write_section(name: str, body: str, results: Path | None = None) -> Path:
    """Puts ``body`` between ``name``'s markers in ``results`` (appended if absent)."""
    begin, end = markers(name)
    if not body.startswith(begin):
        body = f"{begin}\n{body.strip()}\n{end}\n"
    target = results or RESULTS
    text = target.read_text() if target.exists() else ""
    if begin in text and end in text:
        before, rest = text.split(begin, 1)
        after = rest.split(end, 1)[1].lstrip("\n")
        text = before + body + ("\n" + after if after else "")
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + body
    target.write_text(text)
    return target


def environment(
    command: str | None = None, *, versions_extra: str = "", machine_note: str = ""
) -> list[str]:
    """The lines every report starts with: the command (when given), date, versions, machine.

    Args:
      command: the command line that produced the report, or None (the caller writes it).
      versions_extra: more versions, put before Python's (``"orbax-checkpoint 0.12, "``).
      machine_note: appended to the machine line (``", profile `cpu`"``).

    Example:
      >>> environment("python benchmarks/x.py")[0]
      '- command: `python benchmarks/x.py`'
    """
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return [
        *([f"- command: `{command}`"] if command is not None else []),
        f"- date: {date}",
        f"- versions: jax {jax.__version__}, flax {flax.__version__}, optax {optax.__version__}, "
        f"{versions_extra}Python {platform.python_version()}",
        f"- machine: {platform.machine()}, nproc {os.cpu_count()}, {jax.device_count()} "
        f"emulated {jax.devices()[0].platform.upper()} devices{machine_note}",
    ]
