"""``fleet.collective_perf``, the five ``*_perf`` methods and ``python -m jfleet.collective_perf``.

On the suite's 8 CPU devices as dp2 x mp4: the table over dp, mp and the whole mesh, the
values each timed program computes (against numpy), the collective in its compiled HLO,
nccl-tests' bandwidth formulas on hand-computed numbers, the slow-threshold warning,
Paddle's default groups and bad input. The script runs once as a 2-process job.
"""

from __future__ import annotations

import json
import logging
import math
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet import fleet
from jfleet.fleet.perf import PerfMethods
from jfleet.mesh import collective_perf as cp
from jfleet.mesh.collective_perf.__main__ import default_mesh, main
from jfleet.mesh.topology import DP, MP, PP, SHARDING
from jfleet.testing.hlo import collectives
from tests.fleet_setup import init_fleet
from tests.subprocess_util import paddle_launch_envs, run_many

WORLD = "world"
PERF = PerfMethods()  # the Fleet mixin, bound to the current run like fleet's methods


def _hcg(dp: int = 2, mp: int = 4, **more: int):
    init_fleet({"dp_degree": dp, "mp_degree": mp, **{f"{k}_degree": v for k, v in more.items()}})
    return fleet.get_hybrid_communicate_group()


# ----- formulas: nccl-tests' doc/PERFORMANCE.md, numbers worked by hand -------------------


@pytest.mark.parametrize(
    ("op", "nbytes", "nranks", "time_s", "algbw", "busbw"),
    [
        ("allreduce", 10**9, 8, 0.5, 2.0, 3.5),  # 2 GB/s * 2*7/8
        ("allreduce", 10**6, 2, 1e-3, 1.0, 1.0),  # 2*1/2 = 1
        ("allreduce", 3 * 10**6, 4, 1e-3, 3.0, 4.5),  # 3 * 2*3/4
        ("allgather", 10**6, 4, 2e-3, 2.0, 1.5),  # S = 4 ranks x 1 MB; 2 * 3/4
        ("reduce_scatter", 4 * 10**6, 4, 2e-3, 2.0, 1.5),  # S = the 4 MB input; 2 * 3/4
        ("reduce_scatter", 8 * 10**6, 8, 1e-3, 8.0, 7.0),  # 8 * 7/8
        ("broadcast", 3 * 10**6, 8, 1e-3, 3.0, 3.0),
        ("reduce", 5 * 10**6, 4, 1e-3, 5.0, 5.0),
    ],
)
def test_bandwidth_formulas(op, nbytes, nranks, time_s, algbw, busbw):
    got = cp.bandwidths(op, nbytes, nranks, time_s)
    assert got == pytest.approx((algbw, busbw), rel=1e-12)


# The bus factor of each (op, group size) on the dp2 x mp4 mesh, written out.
FACTORS = {
    ("allreduce", 2): 1.0, ("allreduce", 4): 1.5, ("allreduce", 8): 1.75,
    ("allgather", 2): 0.5, ("allgather", 4): 0.75, ("allgather", 8): 0.875,
    ("reduce_scatter", 2): 0.5, ("reduce_scatter", 4): 0.75, ("reduce_scatter", 8): 0.875,
    **{(op, n): 1.0 for op in ("broadcast", "reduce") for n in (2, 4, 8)},
}  # fmt: skip


# ----- the table -------------------------------------------------------------------------


def test_table_of_every_op_over_dp_mp_and_the_mesh():
    hcg = _hcg()
    sizes = [1024, 65536]
    results = cp.sweep(hcg, cp.OPS, [DP, MP, WORLD], sizes, round=3)
    ranks = {DP: 2, MP: 4, WORLD: 8}
    want = [(s, op, g) for s in sizes for op in cp.OPS for g in (DP, MP, WORLD)]
    assert [(r.nbytes, r.op, r.group) for r in results] == want
    for r in results:
        assert r.nranks == ranks[r.group] and r.round == 3 and not r.slow
        assert r.threshold_s is None
        assert math.isfinite(r.time_s) and 0 < r.min_time_s <= r.time_s
        size = r.nbytes * r.nranks if r.op == "allgather" else r.nbytes
        assert r.total_bytes == size
        assert r.algbw_gbps == pytest.approx(size / r.time_s / 1e9, rel=1e-12)
        assert r.busbw_gbps / r.algbw_gbps == pytest.approx(FACTORS[r.op, r.nranks], rel=1e-12)
    assert {r.axes for r in results} == {(DP,), (MP,), tuple(hcg.mesh.axis_names)}
    text = cp.format_table(results).splitlines()
    assert len(text) == 1 + len(results) and "busbw_GB/s" in text[0]
    for line, r in zip(text[1:], results, strict=True):
        assert line.split()[:4] == [cp.format_size(r.nbytes), r.op, r.group, str(r.nranks)]
    assert json.loads(json.dumps(results[0].to_dict()))["axes"] == [DP]


def _expected(op: str, x: np.ndarray) -> np.ndarray:
    """Each rank's result over ``mp`` from its tensor, x: [dp, mp, m] (numpy only)."""
    dp, mp, m = x.shape
    total = x.sum(axis=1, keepdims=True)
    if op == "allreduce":
        return np.broadcast_to(total, x.shape)
    if op == "reduce":  # the sum on mp rank 0, the others keep theirs
        return np.concatenate([total, x[:, 1:]], axis=1)
    if op == "broadcast":
        return np.broadcast_to(x[:, :1], x.shape)
    if op == "allgather":  # every rank: its dp row's tensors, concatenated in mp order
        return np.broadcast_to(x.reshape(dp, 1, mp * m), (dp, mp, mp * m))
    return total.reshape(dp, mp, m // mp)  # reduce_scatter: mp rank j keeps sum part j


# What each timed program must contain: (HLO kind, bytes per execution) for m floats.
HLO = {
    "allreduce": ("all-reduce", 1),
    "reduce": ("all-reduce", 1),
    "broadcast": ("all-reduce", 1),  # XLA:CPU: a masked psum (no collective-broadcast)
    "allgather": ("all-gather", 4),
    "reduce_scatter": ("reduce-scatter", 1),
}


@pytest.mark.parametrize("op", cp.OPS)
def test_the_timed_program_computes_the_collective(op):
    hcg = _hcg()
    mesh, m = hcg.mesh, 8
    x = np.random.default_rng(0).normal(size=(2, 4, m)).astype(np.float32)
    spec = P(tuple(mesh.axis_names))
    arr = jax.device_put(x.reshape(-1), NamedSharding(mesh, spec))  # device d holds rank d's
    fn = cp.collective_fn(op, mesh, (MP,), spec)
    out = np.asarray(fn(arr)).reshape(2, 4, -1)
    np.testing.assert_allclose(out, _expected(op, x), rtol=1e-6, atol=1e-6)
    kind, times = HLO[op]
    found = [c for c in collectives(fn.lower(arr).compile().as_text()) if c.kind == kind]
    assert [(c.group_size, c.bytes) for c in found] == [(4, times * m * 4)]
    result = cp.measure(op, arr, hcg.get_model_parallel_group(), round=1)
    assert (result.nbytes, result.total_bytes) == (m * 4, times * m * 4)


# ----- Paddle's methods: thresholds, groups, no-ops -----------------------------------------


def test_a_slow_size_warns_naming_op_size_time_and_threshold(caplog):
    hcg = _hcg()
    x = np.zeros(64, np.float32)
    with caplog.at_level(logging.INFO, logger="jfleet"):
        r = PERF.allreduce_perf(2, x, hcg.get_data_parallel_group(), 256, 1e-12)
        fast = PERF.broadcast_perf(2, x, WORLD, 256, 1e3)
        off = PERF.reduce_perf(2, x, MP, 256, -1)
    assert r.slow and r.threshold_s == 1e-12 and (r.op, r.group, r.nbytes) == ("allreduce", DP, 256)
    assert not fast.slow and fast.nranks == 8 and not off.slow and off.threshold_s is None
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "AllReduce Test Timeout! allreduce over dp (2 ranks), nbytes 256B" in warnings[0]
    assert f"{r.time_s:.6g} s/iter > threshold 1e-12 s" in warnings[0]
    info = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.INFO]
    assert any(m.startswith("[BroadcastTest] nbytes 256B over world (8 ranks)") for m in info)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jfleet"):
        rs = PERF.collective_perf("allgather", 2, {1024: 1e-12, 2048: 1e3, 4096: -1})
    assert [(r.group, r.nbytes, r.slow) for r in rs] == [
        (MP, 1024, True), (MP, 2048, False), (MP, 4096, False)
    ]  # fmt: skip
    assert len(caplog.records) == 1 and "allgather over mp (4 ranks), nbytes 1024B" in (
        caplog.records[0].getMessage()
    )
    assert PERF.allreduce_perf(1, x, DP, 256, 1e-12, warmup=True) is None


def test_paddle_default_groups_and_what_does_nothing(caplog, monkeypatch):
    hcg = _hcg()
    for op, name, n in [("allreduce", DP, 2), ("reduce", DP, 2), ("broadcast", DP, 2),
                        ("allgather", MP, 4), ("reduce_scatter", MP, 4)]:  # fmt: skip
        g = cp.default_group(op, hcg)
        assert (g.name, g.nranks) == (name, n)
    sharded = cp.default_group("allreduce", _hcg(dp=1, mp=2, sharding=4))
    assert (sharded.name, sharded.nranks) == (SHARDING, 4)  # dp has 1 rank: the sharding group
    _hcg(dp=1, mp=8)
    with caplog.at_level(logging.WARNING, logger="jfleet"):
        assert PERF.collective_perf("broadcast", 2, {64: 1.0}) == []
        assert PERF.allgather_perf(2, np.zeros(8, np.float32), None, 32, 1.0) is None
        assert PERF.reduce_perf(2, np.zeros(8, np.float32), DP, 32, 1.0) is None
    messages = [r.getMessage() for r in caplog.records]
    assert "broadcast_perf is invalid, group invalid!" in messages[0]
    assert "dp and sharding have 1 rank each" in messages[0]
    assert "allgather_perf is invalid" in messages[1] and "group None" in messages[1]
    assert "reduce_perf is invalid" in messages[2] and "'dp' with 1 rank" in messages[2]
    # None or {}: Paddle's documented 1MB .. 1GB sweep without thresholds
    assert tuple(2**k for k in range(20, 31)) == cp.DEFAULT_SIZES
    monkeypatch.setattr("jfleet.collective_perf.timing.DEFAULT_SIZES", (64, 128))
    for default in (None, {}):
        rs = PERF.collective_perf("allreduce", 1, default, group=WORLD)
        assert [(r.nbytes, r.threshold_s, r.slow) for r in rs] == [(64, None, False)] * 1 + [
            (128, None, False)
        ]


def test_collective_perf_takes_hcg_without_a_run():
    hcg = _hcg()
    fleet._reset()
    rs = PERF.collective_perf("reduce_scatter", 1, {48: -1}, hcg=hcg, group=f"{DP}+{MP}")
    # 48 bytes = 12 floats, rounded down to a multiple of the 8 ranks: 8 floats
    assert [(r.group, r.nranks, r.nbytes) for r in rs] == [(f"{DP}+{MP}", 8, 32)]
    with pytest.raises(RuntimeError, match=r"fleet.collective_perf needs fleet.init\(\) first"):
        PERF.collective_perf("allreduce", 1, {64: 1})


# ----- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: PERF.collective_perf("all_reduce", 1, {64: 1}), ValueError,
         r"comm_type='all_reduce' is not a collective.*'allreduce', 'reduce', 'broadcast', "
         r"'allgather', 'reduce_scatter'"),
        (lambda: PERF.collective_perf("allreduce", -1, {64: 1}), ValueError,
         r"round=-1 must be a positive int; time at least one call"),
        (lambda: PERF.collective_perf("allreduce", True, {64: 1}), ValueError, r"round=True"),
        (lambda: PERF.collective_perf("allreduce", 1, {0: 1}), ValueError,
         r"size_and_time key=0 must be a positive int; sizes are bytes"),
        (lambda: PERF.collective_perf("allreduce", 1, {-5: 1}), ValueError, r"key=-5"),
        (lambda: PERF.collective_perf("allreduce", 1, {"1MB": 1}), ValueError, r"key='1MB'"),
        (lambda: PERF.collective_perf("allreduce", 1, {2: 1}), ValueError,
         r"key=2 bytes is smaller than one float32 \(4 bytes\)"),
        (lambda: PERF.collective_perf("allreduce", 1, [64]), ValueError,
         r"size_and_time=\[64\] \(list\) must be a dict of message size in bytes"),
        (lambda: PERF.collective_perf("allreduce", 1, {64: "fast"}), ValueError,
         r"size_and_time\[64\]='fast' is not a time; expected seconds"),
        (lambda: PERF.collective_perf("allreduce", 1, {64: float("nan")}), ValueError,
         r"must be finite seconds"),
        (lambda: PERF.collective_perf("allreduce", 1, {64: 1}, group="tp"), ValueError,
         r"group 'tp' is not a group of this mesh; expected 'world', a mesh axis \['dp'"),
        (lambda: PERF.collective_perf("allreduce", 1, {64: 1}, group=f"{MP}+{MP}"), ValueError,
         r"group 'mp\+mp' is not a group of this mesh.*each once"),
        (lambda: PERF.allreduce_perf(1, np.zeros(8), 3, 32, 1), TypeError,
         r"allreduce_perf: group=3 \(int\) is not a group; pass a Group"),
        (lambda: PERF.allreduce_perf(0, np.zeros(8), DP, 32, 1), ValueError,
         r"iteration=0 must be a positive int"),
        (lambda: PERF.allgather_perf(1, np.zeros(8), MP, 0, 1), ValueError,
         r"perf_size=0 must be a positive int; pass the message size in bytes"),
        (lambda: PERF.broadcast_perf(1, np.float32(1), MP, 4, 1), ValueError,
         r"broadcast_perf: x is 0-d \(a scalar\); pass a 1-d tensor"),
        (lambda: PERF.reduce_scatter_perf(1, np.zeros(6, np.float32), MP, 24, 1), ValueError,
         r"each rank's tensor has 6 rows \(shape \(6,\)\), which the 4 ranks of group 'mp' "
         r"cannot share equally; use a first dimension divisible by 4"),
        (lambda: cp.measure("allreduce", np.zeros(8), cp.group_of(fleet.get_hybrid_communicate_group(), "pp"), round=1),  # noqa: E501
         ValueError, r"group 'pp' has 1 rank; a collective needs at least 2"),
        (lambda: cp.bus_factor("gather", 4), ValueError, r"op='gather' is not a collective"),
        (lambda: cp.parse_size("0KB"), ValueError, r"size '0KB' is not a positive size"),
        (lambda: cp.parse_size("1TB"), ValueError, r"size '1TB'.*B, KB, MB or GB"),
    ],
)  # fmt: skip
def test_bad_input_is_a_clear_error(call, error, match):
    _hcg()
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize(
    ("devices", "groups", "want"),
    [
        (8, [DP, MP, WORLD], {DP: 2, MP: 4}),  # the inner axis takes the larger share
        (16, [MP, DP], {DP: 4, MP: 4}),
        (6, [f"{DP}+{MP}"], {DP: 2, MP: 3}),
        (8, [DP, PP, MP], {DP: 2, PP: 2, MP: 2}),
        (7, [DP, MP], {DP: 1, MP: 7}),
        (8, [WORLD], {}),
    ],
)
def test_the_script_splits_the_devices_between_the_named_axes(devices, groups, want):
    assert default_mesh(devices, groups) == {f"{a}_degree": d for a, d in want.items()}


def test_the_script_refuses_bad_arguments(capsys, monkeypatch):
    for argv, match in [
        (["--sizes", "1KB,0MB"], "size '0MB' is not a positive size"),
        (["--ops", "allreduce,gather"], "--ops entry='gather' is not a collective"),
        (["--mesh", "dp=2,tp=4"], "'tp=4' is not axis=degree with axis one of dp, pp"),
        (["--round", "0"], "--round=0 must be a positive int"),
        (["--groups", "tp", "--sizes", "64"], "group 'tp' is not a group of this mesh"),
        (["--mesh", "dp=3", "--sizes", "64"], "= 3, but there are 8 devices"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and match in capsys.readouterr().err, argv
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(SystemExit):
        main(["--plot", "out.png"])
    assert "needs matplotlib: `pip install matplotlib`" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match=r"needs matplotlib.*`pip install matplotlib`"):
        cp.plot([], "out.png")


# ----- the script, as a 2-process job -------------------------------------------------------

SCRIPT = """
import runpy, sys
sys.argv = ["collective_perf", "--groups", "dp,mp,world", "--ops", "all",  # mesh: dp2 x mp4
            "--sizes", "4KB", "--round", "2", "--devices", "4", "--json", {json!r},
            "--plot", {png!r}]
runpy.run_module("jfleet.collective_perf", run_name="__main__", alter_sys=True)
"""


def test_the_script_prints_the_table_on_process_zero(tmp_path):
    out_json, out_png = str(tmp_path / "perf.json"), str(tmp_path / "perf.png")
    code = SCRIPT.format(json=out_json, png=out_png)
    procs = run_many([code, code], envs=paddle_launch_envs(2), timeout=120)
    for p in procs:
        assert p.returncode == 0, p.stderr[-3000:]
    out = procs[0].stdout  # after Gloo's connection lines
    lines = out[out.index("collective_perf: ") :].splitlines()
    assert lines[0].startswith("collective_perf: 2 process(es), 8 cpu devices")
    rows = [line.split()[:4] for line in lines[2:]]
    want = [["4KB", op, g, str(n)] for op in cp.OPS
            for g, n in ((DP, 2), (MP, 4), (WORLD, 8))]  # fmt: skip
    assert rows == want and lines[1].split()[:4] == ["size", "op", "group", "ranks"]
    assert "collective_perf" not in procs[1].stdout and "allreduce" not in procs[1].stdout
    saved = json.loads((tmp_path / "perf.json").read_text())
    assert saved["processes"] == 2 and len(saved["results"]) == len(want)
    assert all(r["time_s"] > 0 and r["busbw_gbps"] > 0 for r in saved["results"])
    assert (tmp_path / "perf.png").read_bytes()[:4] == b"\x89PNG"
