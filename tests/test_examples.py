"""The scripts in examples/ run as a user runs them and print what the README promises."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.subprocess_util import REPO_ROOT, child_env

TIMEOUT = 240


def run_example(script: str, *args: str) -> subprocess.CompletedProcess:
    """Runs ``examples/<script>`` in a child interpreter (8 emulated CPU devices)."""
    cmd = [sys.executable, str(REPO_ROOT / "examples" / script), *args]
    try:
        return subprocess.run(
            cmd,
            env=child_env(),
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired as err:
        raise AssertionError(
            f"{' '.join(cmd)} ran past {TIMEOUT}s\nstdout:\n{err.stdout}\nstderr:\n{err.stderr}"
        ) from err


def check_ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_hybrid_topology_prints_the_default_layout():
    out = check_ok(run_example("hybrid_topology.py"))
    assert "mesh axes: {'dp': 2, 'pp': 2, 'sharding': 1, 'sep': 1, 'ep': 1, 'mp': 2}" in out
    assert "parallel mode:" in out
    ranks = re.findall(r"^\s+(\d+)\s+\((\d+(?:, \d+)*)\)\s+\S", out, re.M)
    assert [int(r) for r, _ in ranks] == list(range(8)), out
    # coordinates in (dp, pp, sharding, sep, ep, mp) order, mp innermost
    assert ranks[1][1] == "0, 0, 0, 0, 0, 1" and ranks[7][1] == "1, 1, 0, 0, 0, 1", out
    assert re.search(r"model groups: \[\[0, 1\], \[2, 3\], \[4, 5\], \[6, 7\]\]", out), out


def test_hybrid_topology_takes_other_degrees():
    out = check_ok(
        run_example("hybrid_topology.py", "--dp", "1", "--pp", "1", "--mp", "4", "--sharding", "2")
    )
    assert "mesh axes: {'dp': 1, 'pp': 1, 'sharding': 2, 'sep': 1, 'ep': 1, 'mp': 4}" in out
    out = check_ok(
        run_example("hybrid_topology.py", "--dp", "2", "--ep", "4", "--pp", "1", "--mp", "1")
    )
    assert "mesh axes: {'dp': 2, 'pp': 1, 'sharding': 1, 'sep': 1, 'ep': 4, 'mp': 1}" in out
    assert re.search(r"expert groups: \[\[0, 1, 2, 3\], \[4, 5, 6, 7\]\]", out), out


def parse_training(out: str) -> tuple[list[int], list[float], float, float, str]:
    steps = re.findall(r"^step\s+(\d+)/\d+\s+loss (\d+\.\d+)$", out, re.M)
    final = re.search(r"^first loss (\d+\.\d+)\s+final loss (\d+\.\d+)$", out, re.M)
    meta = re.search(r"^applied meta-optimizers: (.*)$", out, re.M)
    assert steps and final and meta, out
    return (
        [int(s) for s, _ in steps],
        [float(v) for _, v in steps],
        float(final.group(1)),
        float(final.group(2)),
        meta.group(1),
    )


@pytest.mark.parametrize(
    ("args", "mesh", "meta"),
    [
        (
            ["--steps", "10"],
            "{'dp': 2, 'pp': 1, 'sharding': 4, 'sep': 1, 'ep': 1, 'mp': 1}",
            "['ShardingOptimizer']",
        ),
        (
            ["--steps", "6", "--log-every", "2", "--stage", "3", "--amp", "fp16"],
            "{'dp': 2, 'pp': 1, 'sharding': 4, 'sep': 1, 'ep': 1, 'mp': 1}",
            "['ShardingOptimizer', 'AMPOptimizer']",
        ),
        (
            ["--steps", "6", "--dp", "8", "--sharding", "1", "--amp", "bf16"],
            "{'dp': 8, 'pp': 1, 'sharding': 1, 'sep': 1, 'ep': 1, 'mp': 1}",
            "['AMPOptimizer']",
        ),
    ],
    ids=["zero2", "zero3-fp16", "dp8-bf16"],
)
def test_train_fleet_loss_decreases(args, mesh, meta):
    out = check_ok(run_example("train_fleet.py", *args))
    assert f"mesh axes: {mesh}" in out
    steps, logged, first, final, applied = parse_training(out)
    n = int(args[args.index("--steps") + 1])
    assert steps[0] == 1 and steps[-1] == n, out
    assert logged[0] == first and logged[-1] == final, out
    assert final < 0.8 * first, out  # ln(64) ~ 4.16 falls fast on the stride task
    assert applied == meta, out


def test_train_fleet_rejects_degrees_that_do_not_fill_the_devices():
    proc = run_example("train_fleet.py", "--dp", "3", "--sharding", "1", "--steps", "2")
    assert proc.returncode != 0
    assert "ValueError" in proc.stderr, proc.stderr


def parse_layouts(out: str) -> dict[str, str]:
    """``{parameter: spec}`` from the example's lines ``  name (kind)  (shape)  P(...)``."""
    return dict(re.findall(r"^  (\S+)\s.*?\([\d, ]+\)\s+(P\(.*\))$", out, re.M))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_tensor_parallel_gpt_trains_at_dp2_mp4(sequence_parallel):
    args = ["--steps", "12", "--log-every", "4"]
    if sequence_parallel:
        args.append("--sequence-parallel")
    out = check_ok(run_example("tensor_parallel_gpt.py", *args))
    assert "mesh axes: {'dp': 2, 'pp': 1, 'sharding': 1, 'sep': 1, 'ep': 1, 'mp': 4}" in out, out
    assert "model parallel groups: [[0, 1, 2, 3], [4, 5, 6, 7]]" in out, out
    assert f"sequence parallel {'on' if sequence_parallel else 'off'}" in out, out
    layouts = parse_layouts(out)
    assert layouts["attn.qkv.kernel"] == "P(None, 'mp')", out  # column: output dim split
    assert layouts["attn.o.kernel"] == "P('mp', None)", out  # row: input dim split
    assert layouts["mlp.up.kernel"] == "P(None, 'mp')", out
    assert layouts["mlp.down.kernel"] == "P('mp', None)", out
    assert layouts["embed.embedding"] == "P('mp', None)", out  # vocabulary split
    assert layouts["norm1.scale"] == "P()", out
    # 2 blocks x (norm1, norm2) x (scale, bias) + the final norm's scale and bias
    assert ("LayerNorm scales and biases): 10" in out) == sequence_parallel, out
    steps, logged, first, final, _ = parse_training(out)
    assert steps == [1, 4, 8, 12], out
    assert logged[0] == first and logged[-1] == final, out
    assert final < 0.5 * first, out  # ln(64) ~ 4.16 falls fast on the stride task


def test_tensor_parallel_gpt_rejects_a_sequence_not_divisible_by_mp():
    proc = run_example(
        "tensor_parallel_gpt.py", "--sequence-parallel", "--seq", "6", "--steps", "2"
    )
    assert proc.returncode != 0
    assert "sequence length 6" in proc.stderr and "mp degree 4" in proc.stderr, proc.stderr


def test_pipeline_gpt_trains_with_both_schedules_to_the_same_losses():
    out = check_ok(run_example("pipeline_gpt.py", "--steps", "6", "--log-every", "3"))
    assert "== schedule FThenB" in out and "== schedule 1F1B" in out, out
    assert "P('pp', None, None, 'mp')" in out, out  # stacked body: stages on pp, Megatron on mp
    assert "10 collective-permutes" in out and "12 collective-permutes" in out, out
    gap = float(out.split("largest loss difference between the schedules:")[1].split()[0])
    assert gap < 1e-4, out
    finals = [float(line.split()[-1]) for line in out.splitlines() if "final loss" in line]
    firsts = [float(line.split()[2]) for line in out.splitlines() if "final loss" in line]
    assert len(finals) == 2 and all(f < 0.8 * s for f, s in zip(finals, firsts, strict=True))


def test_llama_to_distributed_pipelined_trains_to_the_single_device_losses():
    args = ["--steps", "10", "--check", "--mesh", "dp=2,pp=2,mp=2"]
    out = check_ok(run_example("llama_to_distributed.py", *args))
    # the plan table, then the layout it applied
    assert "jfleet plan: dp2 x pp2 x mp2 (FThenB M=2) on 8 devices" in out, out
    assert "stages: 0: blocks 0-1; 1: blocks 2-3" in out, out
    assert "| layers[*].self_attn.o_proj.kernel | 64x64 | o | P('mp', None) |" in out, out
    assert "layout: dp2 x pp2 x mp2 (FThenB M=2)  mesh: {'dp': 2, 'pp': 2," in out, out
    steps = re.findall(r"^step\s+(\d+)/10\s+loss (\d+\.\d+)$", out, re.M)
    assert [int(s) for s, _ in steps] == [1, 5, 10], out
    final = re.search(r"^first loss (\d+\.\d+)\s+final loss (\d+\.\d+)$", out, re.M)
    first, last = float(final.group(1)), float(final.group(2))
    assert (first, last) == (float(steps[0][1]), float(steps[-1][1])), out
    assert last < 0.5 * first, out  # ln(64) ~ 4.16 falls fast on the stride task
    # --check: the same model trained by a plain nnx.jit step on one device
    gap = re.search(r"largest per-step difference (\S+)$", out, re.M)
    assert gap and float(gap.group(1)) < 1e-4, out
    assert "check passed" in out, out


def test_llama_to_distributed_rejects_an_unknown_mesh_axis():
    proc = run_example("llama_to_distributed.py", "--mesh", "dp=2,tp=4")
    assert proc.returncode == 2, proc.stderr  # argparse's usage error, before any training
    assert "'tp=4'" in proc.stderr and "dp, pp, sharding, sep, mp" in proc.stderr, proc.stderr


def test_resume_on_another_mesh_continues_the_uninterrupted_curve(tmp_path):
    args = ["--steps", "4", "--save-at", "2", "--check", "--dir", str(tmp_path)]
    out = check_ok(run_example("resume.py", *args))  # dp2 x pp2 x mp2, resumed on dp8
    saved = "{'dp': 2, 'pp': 2, 'sharding': 1, 'sep': 1, 'ep': 1, 'mp': 2}"
    assert f"restored step 2 (saved on {saved})" in out
    assert "onto dp=8; batches seen: 2" in out, out  # the loader skips them
    rows = re.findall(r"^\s+(\d)\s+(\d+\.\d+)\s+(\d+\.\d+)", out, re.M)
    assert [int(s) for s, _, _ in rows] == [1, 2, 3, 4], out
    whole, resumed = ([float(r[i]) for r in rows] for i in (1, 2))
    assert resumed[:2] == whole[:2], out  # the saved losses, handed over in the checkpoint
    assert max(abs(a - b) for a, b in zip(whole[2:], resumed[2:], strict=True)) <= 1e-5, out
    assert whole[3] < whole[0], out  # it trained
    assert "check passed" in out, out
    assert (tmp_path / "2" / "state").is_dir(), sorted(p.name for p in tmp_path.iterdir())


def test_resume_rejects_a_save_step_outside_the_run():
    proc = run_example("resume.py", "--steps", "4", "--save-at", "4")
    assert proc.returncode == 2, proc.stderr  # argparse's usage error, before any training
    assert "--save-at=4 with --steps=4" in proc.stderr and "1 <= --save-at < --steps" in proc.stderr


def test_bigger_than_one_device_is_created_split_loaded_and_trained():
    out = check_ok(run_example("bigger_than_one_device.py"))
    state, budget = map(float, re.search(r"state ([\d.]+) MiB; budget ([\d.]+) MiB", out).groups())
    assert budget < state / 2, out
    layout, predicted = re.search(
        r"^layout: (.+); predicted ([\d.]+) MiB/device$", out, re.M
    ).groups()
    assert float(predicted) <= budget, out
    assert re.search(
        rf"^loaded into {re.escape(layout)}: largest \|loaded - saved\| = 0$", out, re.M
    )
    first, last = map(float, re.search(r"^loss ([\d.]+) -> ([\d.]+)$", out, re.M).groups())
    assert last < first, out
