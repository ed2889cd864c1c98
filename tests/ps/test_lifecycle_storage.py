"""set_date's decay, shrink's eviction rule, and the save / load modes and cache, round trip."""

from __future__ import annotations

import chex
import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from jfleet.mesh.topology import DP
from jfleet.ps import (
    CtrAccessor,
    SparseSGDRule,
    SparseTable,
    load_table,
    save_cache,
    save_cache_table,
    save_table,
    set_date,
    shrink,
)

ROWS, DIM = 64, 2


@pytest.fixture
def mesh():
    return jax.make_mesh((8,), (DP,), axis_types=(AxisType.Auto,))


def push(table: SparseTable, ids, labels, repeat: int = 1) -> np.ndarray:
    """Pushes instances ``ids`` ``[n, 1]`` with ``labels``; returns each instance's row."""
    b = table.prepare(np.asarray(ids, np.int64), labels=labels)
    g = np.full((b.rows.size, DIM), 0.1, np.float32)
    for _ in range(repeat):
        table.state = table.push(table.state, b.rows, g, b.show, b.click)
    return b.rows[b.inverse[:, 0]]


def host(table: SparseTable):
    return jax.tree.map(np.asarray, table.state)


def test_set_date_decays_and_ages_then_shrink_evicts_by_paddles_rule(mesh):
    acc = CtrAccessor(SparseSGDRule("adam"), show_click_decay_rate=0.5)
    table = SparseTable(ROWS, DIM, acc, mesh=mesh)
    # hot: 10 shows, 4 clicks (score 4.6); cold: 1 show, 0 clicks (score 0.1)
    hot = push(table, [[11]] * 10, [1.0] * 4 + [0.0] * 6)[0]
    cold = push(table, [[12]], [0.0])[0]
    assert set_date(table, "20250301") == 0  # the first date only sets the day
    assert set_date(table, "20250303") == 2
    s = host(table)
    np.testing.assert_allclose(s.show[[hot, cold]], [10 * 0.25, 0.25])
    np.testing.assert_allclose(s.click[hot], 4 * 0.25)
    assert s.unseen_days[hot] == s.unseen_days[cold] == 2 and s.unseen_days.sum() == 4
    with pytest.raises(ValueError, match="before the table's current day"):
        set_date(table, "20250302")
    assert shrink(table) == 1  # cold: 0.025 < delete_threshold 0.8; hot: 0.15 + 1.0 = 1.15
    s2 = host(table)
    assert not s2.present[cold] and s2.show[cold] == 0 and s2.slots["beta1_pow"][cold] == 0.9
    assert s2.emb[cold].tolist() != s.emb[cold].tolist()  # a new random row
    np.testing.assert_array_equal(s2.emb[hot], s.emb[hot])
    assert shrink(table, threshold=1.2) == 1  # hot's score 1.15 < 1.2
    # unseen for more than delete_after_unseen_days: evicted whatever its score
    row = push(table, [[13]] * 50, [1.0] * 50)[0]
    set_date(table, 20250303 + 31)
    assert shrink(table, threshold=0.0) == 1 and not host(table).present[row]


def filled_table(mesh, seed: int = 0) -> tuple[SparseTable, dict[str, int]]:
    table = SparseTable(ROWS, DIM, CtrAccessor(SparseSGDRule("adagrad")), mesh=mesh, seed=seed)
    rows = {
        "base": push(table, [[1]] * 4, [1.0, 1.0, 0.0, 0.0])[0],  # score 2.2 >= 1.5
        "low": push(table, [[2]] * 3, [0.0] * 3)[0],  # score 0.3 < base_threshold 1.5
    }
    table.day = 5
    return table, rows


def test_save_and_load_every_mode_round_trips(mesh, tmp_path):
    table, rows = filled_table(mesh)
    assert save_table(table, tmp_path / "all", 0) == 2
    saved = host(table)
    fresh = SparseTable(ROWS, DIM, table.accessor, mesh=mesh, seed=1, table_id=table.table_id)
    assert load_table(fresh, tmp_path / "all", 0) == 2
    chex.assert_trees_all_close(host(fresh)._replace(emb=0), saved._replace(emb=0))
    live = saved.present
    np.testing.assert_array_equal(host(fresh).emb[live], saved.emb[live])
    assert fresh.day == 5
    # base: only rows scoring >= base_threshold; their delta_score restarts
    assert save_table(table, tmp_path / "base", 2) == 1
    assert host(table).delta_score[rows["base"]] == 0
    # delta: nothing gained since the base save; then a push makes "base" a delta row
    assert save_table(table, tmp_path / "d0", 1) == 0
    push(table, [[1]], [1.0])
    assert save_table(table, tmp_path / "delta", 1) == 1
    base = SparseTable(ROWS, DIM, table.accessor, mesh=mesh, seed=1, table_id=table.table_id)
    assert load_table(base, tmp_path / "base", 2) == 1
    assert host(base).present.sum() == 1 and not host(base).present[rows["low"]]
    assert load_table(base, tmp_path / "delta", 1) == 1  # on top of the base
    np.testing.assert_array_equal(host(base).emb[rows["base"]], host(table).emb[rows["base"]])
    assert host(base).show[rows["base"]] == 5


def test_cache_keeps_the_hottest_rows(mesh, tmp_path):
    table = SparseTable(ROWS, DIM, mesh=mesh)
    for k in range(4):  # feature k: 2 + k clicked shows, all above base_threshold
        push(table, [[100 + k]] * (2 + k), [1.0] * (2 + k))
    push(table, [[200]], [0.0])  # below base_threshold: never cached
    assert save_cache_table(table, pass_id=3, mem_cache_key_threshold=2) == 2
    assert table.cache_threshold == 3.0 and table.cache_pass == 3  # shows 5 and 4 pass
    assert save_cache(table, tmp_path) == 2
    assert save_cache_table(table, 4) == 4


def test_bad_modes_and_mismatched_tables_are_refused(mesh, tmp_path):
    table, _ = filled_table(mesh)
    with pytest.raises(ValueError, match="mode 3"):
        save_table(table, tmp_path, 3)
    save_table(table, tmp_path, 0)
    with pytest.raises(ValueError, match="num_rows=64"):
        load_table(SparseTable(128, DIM, mesh=mesh, table_id=table.table_id), tmp_path, 0)
    with pytest.raises(FileNotFoundError, match="no saved table"):
        load_table(table, tmp_path / "nowhere", 0)
    with pytest.raises(ValueError, match="'YYYYMMDD'"):
        set_date(table, "2025-01-01")
