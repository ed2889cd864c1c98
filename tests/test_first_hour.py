"""What a newcomer meets first: emulated devices, one line per log record, errors with the fix."""

from __future__ import annotations

import logging

import optax
import pytest
from flax import nnx

import jfleet
from jfleet import fleet
from jfleet.models import TinyLM, lm_batches
from jfleet.testing import make_strategy
from tests.subprocess_util import run_python


def test_emulate_devices_gives_a_script_its_devices_and_splits_them_over_a_launchers_processes():
    code = """
        import jfleet
        jfleet.emulate_devices(8)
        import jax
        print("devices", jax.device_count())
    """
    out = run_python(code, env={"JAX_PLATFORMS": ""}).stdout
    assert "devices 8" in out, out
    out = run_python(code, env={"PADDLE_TRAINERS_NUM": "2"}).stdout  # no jax.distributed here
    assert "devices 4" in out, out  # this process's share of the job's 8


def test_jfleet_cpu_devices_is_read_at_import():
    code = "import jfleet, jax; print('devices', jax.device_count())"
    out = run_python(code, env={"JFLEET_CPU_DEVICES": "4"}).stdout
    assert "devices 4" in out, out
    bad = run_python(code, env={"JFLEET_CPU_DEVICES": "four"})
    assert bad.returncode != 0 and "JFLEET_CPU_DEVICES='four'" in bad.stderr, bad.stderr


def test_too_few_devices_says_how_to_emulate_them():
    with pytest.raises(ValueError, match=r"only 8 are present.*jfleet.emulate_devices\(16\)"):
        jfleet.to_distributed(TinyLM(), optax.sgd(0.1), lm_batches(1), device_num=16)
    with pytest.raises(RuntimeError, match="JFLEET_CPU_DEVICES=N"):
        jfleet.emulate_devices(4)  # JAX runs on 8 already


def test_a_jfleet_record_prints_once_even_when_a_library_configured_the_root_logger():
    code = """
        import logging
        logging.basicConfig()  # what importing orbax does: a console handler on the root
        from jfleet import fleet
        fleet.init(is_collective=True)
    """
    err = run_python(code).stderr
    lines = [line for line in err.splitlines() if "fleet initialised" in line]
    assert len(lines) == 1 and lines[0].startswith("[jfleet INFO]"), err


def test_an_applications_own_root_handlers_each_get_a_record_once_and_the_console_prints_once():
    code = """
        import logging, sys
        logging.basicConfig(stream=sys.stdout, format="APP %(name)s: %(message)s")
        seen = []
        class Collect(logging.Handler):
            def emit(self, record):
                seen.append(record.getMessage())
        logging.getLogger().addHandler(Collect())
        from jfleet import fleet
        fleet.init(is_collective=True)
        print("collected", sum("fleet initialised" in m for m in seen))
    """
    run = run_python(code)
    console = (run.stdout + run.stderr).splitlines()
    printed = [line for line in console if "fleet initialised" in line]
    assert len(printed) == 1 and printed[0].startswith("APP jfleet: "), console  # its format
    assert "collected 1" in run.stdout, console


@pytest.fixture
def jfleet_console():
    """The jfleet logger configured before the test's call phase, whose capture pytest 9
    then also attaches to it (pytest attaches to every non-propagating logger)."""
    from jfleet.runtime.log import set_log_level

    set_log_level("INFO")


def test_each_handler_sees_a_record_once_under_pytests_capture(jfleet_console, caplog):
    seen = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    own = Collect()
    logging.getLogger().addHandler(own)
    try:
        with caplog.at_level(logging.INFO, logger="jfleet"):
            fleet.init(is_collective=True, log_level="INFO")
            logging.getLogger("jfleet").info("one record")
    finally:
        logging.getLogger().removeHandler(own)
    assert seen.count("one record") == 1, seen
    assert caplog.messages.count("one record") == 1, caplog.messages


def test_records_still_reach_the_roots_other_handlers_and_the_level_quiets_jax(caplog):
    with caplog.at_level(logging.INFO, logger="jfleet"):
        fleet.init(is_collective=True, log_level="INFO")
    assert any("fleet initialised" in r.getMessage() for r in caplog.records)
    fleet.init(is_collective=True, log_level="ERROR")
    assert logging.getLogger("jax").level == logging.ERROR
    assert logging.getLogger("absl").level == logging.ERROR


def test_a_plain_model_under_pp_points_to_pipeline_layer_and_to_distributed():
    fleet.init(is_collective=True, strategy=make_strategy(dict(pp_degree=2)))
    with pytest.raises(TypeError, match=r"PipelineLayer.*jfleet.to_distributed"):
        fleet.distributed_model(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))


def test_the_notebooks_extra_installs_what_the_readme_notebook_command_needs():
    import tomllib

    from tests.subprocess_util import REPO_ROOT

    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extras = extras["optional-dependencies"]
    readme = (REPO_ROOT / "README.md").read_text()
    assert 'pip install -e ".[notebooks]"' in readme and "jupyter nbconvert" in readme
    for extra in ("notebooks", "dev"):
        assert any(req.startswith("nbconvert") for req in extras[extra]), extra
    assert any(req.startswith("sphinx") for req in extras["dev"])
    assert run_python("import nbconvert, ipykernel").returncode == 0
