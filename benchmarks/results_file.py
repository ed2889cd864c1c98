"""The one way a benchmark writes its table into ``benchmarks/RESULTS.md``.

Each benchmark owns a section between ``<!-- NAME: begin -->`` and ``<!-- NAME: end -->``
markers; rerunning one replaces its section and leaves the others as they are.
"""

from __future__ import annotations

from pathlib import Path

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
