"""The results as text, JSON-ready dicts and a plot; sizes written as ``1KB`` / ``16MB``.

Example:
  >>> from jfleet.mesh.collective_perf.report import format_size, parse_size
  >>> parse_size("16MB"), format_size(1 << 20), format_size(1536)
  (16777216, '1MB', '1536B')
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from jfleet.mesh.collective_perf.timing import OPS, PerfResult

__all__ = ["format_size", "format_table", "parse_size", "plot"]

#: Binary units: 1KB = 1024 bytes, as Paddle's ``1 << 20`` is its "1MB".
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def format_size(nbytes: int) -> str:
    """``1024`` -> ``"1KB"``, ``1536`` -> ``"1536B"`` (binary units, whole numbers only)."""
    for unit in ("G", "M", "K"):
        if nbytes >= _UNITS[unit] and nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}B"
    return f"{nbytes}B"


def parse_size(text: str | int) -> int:
    """``"1KB"`` / ``"1KiB"`` -> 1024, ``"16MB"`` -> 16 << 20, ``"512"`` / ``"512B"`` -> 512.

    Raises:
      ValueError: not a positive whole number of bytes with an optional unit.
    """
    match = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(?:i?[bB])?\s*", str(text))
    if isinstance(text, bool) or not match or int(match.group(1)) < 1:
        raise ValueError(
            f"size {text!r} is not a positive size; expected bytes with an optional unit "
            "B, KB, MB or GB (1KB = 1024 bytes), e.g. 1KB or 16MB."
        )
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def format_table(results: Sequence[PerfResult]) -> str:
    """The results as a text table, one row per result, in their order."""
    head = ("size", "op", "group", "ranks", "time_us", "min_us", "algbw_GB/s", "busbw_GB/s", "")
    rows = [
        (
            format_size(r.nbytes), r.op, r.group, str(r.nranks), f"{r.time_s * 1e6:.1f}",
            f"{r.min_time_s * 1e6:.1f}", f"{r.algbw_gbps:.4g}", f"{r.busbw_gbps:.4g}",
            "SLOW" if r.slow else "",
        )
        for r in results
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [head, *rows]
    )


def plot(results: Sequence[PerfResult], path: str) -> None:
    """Writes a PNG of bus bandwidth against size, one panel per op, a line per group.

    Raises:
      RuntimeError: matplotlib is not installed (``pip install matplotlib``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError(
            f"plotting to {path!r} needs matplotlib, which is not installed; "
            "`pip install matplotlib` (or `pip install -e .[dev]`), or leave out --plot."
        ) from err
    ops = [op for op in OPS if any(r.op == op for r in results)]
    fig, axs = plt.subplots(1, max(len(ops), 1), figsize=(4 * max(len(ops), 1), 3.5))
    for ax, op in zip(np.atleast_1d(axs), ops, strict=False):
        for name in dict.fromkeys(r.group for r in results if r.op == op):
            rs = sorted(
                (r for r in results if r.op == op and r.group == name), key=lambda r: r.nbytes
            )
            ax.plot([r.nbytes for r in rs], [r.busbw_gbps for r in rs], "o-", label=name)
        ax.set(xscale="log", xlabel="bytes per rank", ylabel="busbw (GB/s)", title=op)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
