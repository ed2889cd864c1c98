"""The README's Quick start and CI stay in step."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", section, re.S)
    if block is None:
        raise AssertionError("README's Quick start has no code block")
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_quick_start_is_exactly_two_commands():
    commands = quick_start_commands()
    assert len(commands) == 2, commands
    assert commands[0].startswith("pip install") and "python examples/" in commands[0]
    assert commands[1].startswith("pip install") and "pytest" in commands[1]


def test_ci_runs_the_readme_test_command_verbatim():
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert quick_start_commands()[1] in ci_lines


def test_main_example_named_in_readme_exists():
    script = re.search(r"python (examples/\S+\.py)", quick_start_commands()[0]).group(1)
    assert (ROOT / script).is_file()
