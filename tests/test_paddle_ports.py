"""Paddle's own hybrid-parallel test scripts, ported (examples/paddle_ports), pass unchanged.

Each port runs in this process (8 emulated devices; the launcher gives ``fleet.init`` the
devices Paddle's test driver gives the script) with the Paddle script's own assertions.
Every line changed beyond the framework swap ends in ``# PORT:``; there are at most two per
script, and docs/porting_from_paddle.md lists each of them.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PORTS = REPO / "examples" / "paddle_ports"
GUIDE = REPO / "docs" / "porting_from_paddle.md"

_spec = importlib.util.spec_from_file_location("paddle_ports_launch", PORTS / "launch.py")
launch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launch)

#: A changed line: code, then a trailing ``# PORT: why`` comment.
PORT_LINE = re.compile(r"^\s*[^#\s].*#\s*PORT:\s*\S")
SCRIPTS = sorted(p.name for p in PORTS.glob("*.py") if p.name in launch.DEVICES)


def port_lines(name: str) -> list[str]:
    return [line for line in (PORTS / name).read_text().splitlines() if PORT_LINE.match(line)]


def guide_counts() -> dict[str, int]:
    """The guide's table of ports: ``| `name.py` | Paddle path | count | ... |``."""
    rows = re.findall(r"^\| `([\w.]+\.py)` \|[^|]*\|\s*(\d+)\s*\|", GUIDE.read_text(), re.M)
    return {name: int(count) for name, count in rows}


@pytest.mark.parametrize("name", SCRIPTS)
def test_port_passes_its_own_assertions(name):
    launch.run(PORTS / name)


def test_port_lines_are_at_most_two_and_listed_in_the_guide():
    counts = guide_counts()
    assert sorted(counts) == SCRIPTS, "the guide's table lists every port, no other"
    for name in SCRIPTS:
        lines = port_lines(name)
        assert len(lines) <= 2, f"{name}: {len(lines)} changed lines: {lines}"
        assert counts[name] == len(lines), f"{name}: guide says {counts[name]}, file has {lines}"
        text = GUIDE.read_text()
        for line in lines:
            why = line.split("# PORT:", 1)[1].split("#", 1)[0].strip()
            assert why in text, f"{name}: the guide does not list the change {why!r}"


def test_port_line_counter_counts_only_marked_code():
    assert PORT_LINE.match("    x = 1  # PORT: why")
    assert not PORT_LINE.match("# PORT: a header line")
    assert not PORT_LINE.match("    x = 1  # PORT:")
    assert not PORT_LINE.match("    x = 1  # swap")


def guide_jfleet_names() -> list[str]:
    """Every dotted ``jfleet.`` name in the guide's tables (backticked, before any call)."""
    names = re.findall(r"`(jfleet(?:\.\w+)+)", GUIDE.read_text())
    return sorted(set(names))


def resolve(dotted: str) -> object:
    """Imports the longest module prefix of ``dotted`` and walks the attributes left."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_every_jfleet_name_in_the_guide_exists():
    names = guide_jfleet_names()
    assert len(names) >= 40
    missing = []
    for name in names:
        try:
            resolve(name)
        except (ImportError, AttributeError) as err:
            missing.append(f"{name} ({err})")
    assert not missing, "names in the guide that do not exist: " + "; ".join(missing)


def test_launcher_refuses_more_devices_than_present():
    too_many = r"--devices 9 asks for more devices than the 8 present"
    with pytest.raises(ValueError, match=too_many), launch.selected_devices(9):
        pass


def test_launcher_needs_a_device_count_for_an_unknown_script(tmp_path):
    script = tmp_path / "my_script.py"
    script.write_text("raise SystemExit(0)\n")
    with pytest.raises(ValueError, match=r"my_script.py has no device count; pass devices="):
        launch.run(script)
    launch.run(script, devices=2)  # a given count runs it


def test_launcher_reports_a_failing_script(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("raise SystemExit(1)\n")
    with pytest.raises(AssertionError, match=r"fails.py failed \(exit status 1\)"):
        launch.run(script, devices=2)


def test_launcher_gives_fleet_init_its_devices():
    from jfleet import fleet

    with launch.selected_devices(2):
        fleet.init(is_collective=True, log_level="WARNING")
        assert fleet.get_hybrid_communicate_group().mesh.devices.size == 2
    fleet.init(is_collective=True, log_level="WARNING")
    assert fleet.get_hybrid_communicate_group().mesh.devices.size == 8
