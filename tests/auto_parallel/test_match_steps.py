"""The matcher's named steps, each on its own: module tree -> trace -> projections -> pairs ->
blocks -> roles -> head -> parameter table (``match_patterns`` only chains them)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jfleet.auto_parallel.match.module_parts import (
    find_blocks,
    find_embeddings,
    find_head,
    find_norms,
    read_parts,
)
from jfleet.auto_parallel.match.patterns import (
    dot_costs,
    find_pairs,
    find_projections,
    name_roles,
    param_infos,
    path_str,
    trace_step,
)
from jfleet.models.llama import TinyLlama
from tests.auto_parallel.conv_net import ConvNet


def _llama():
    return nnx.eval_shape(lambda: TinyLlama(vocab=64, width=32, heads=4, kv_heads=2, layers=2))


def _through_pairs(model, inputs=None):
    parts = read_parts(model)
    find_embeddings(parts)
    find_norms(parts)
    trace, _ = trace_step(model, inputs, None, parts)
    blocks = find_blocks(parts)
    projections = find_projections(trace, parts, blocks)
    return parts, trace, blocks, projections, find_pairs(trace, parts, blocks)


def test_module_tree_gives_dense_layers_embedding_and_norms_before_any_trace():
    parts = read_parts(_llama())
    find_embeddings(parts)
    find_norms(parts)
    dense = {path_str(d.kernel) for d in parts.dense}
    assert "layers.0.self_attn.q_proj.kernel" in dense
    assert (parts.width, parts.vocab, parts.norm) == (32, 64, "rmsnorm")
    assert parts.roles[("embed_tokens", "embedding")] == ("embedding", "table", 0, 64)
    assert parts.roles[("norm", "scale")][0] == "norm"


def test_trace_step_traces_default_tokens_only_with_a_token_embedding():
    parts = read_parts(_llama())
    find_embeddings(parts)
    trace, tokens = trace_step(_llama(), None, None, parts)
    assert tokens == (2, 8) and trace.input_shapes == ((2, 8),)
    conv = ConvNet()
    parts = read_parts(conv)
    assert trace_step(conv, None, None, parts) == (None, None)
    assert "not traced" in parts.notes[0]


def test_projections_are_the_traced_kernels_and_a_bare_table_becomes_the_embedding():
    class BareTable(nnx.Module):
        def __init__(self):
            self.table = nnx.Param(jnp.zeros((50, 8)))
            self.up = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
            self.down = nnx.Linear(16, 8, rngs=nnx.Rngs(1))

        def __call__(self, ids):
            return self.down(nnx.relu(self.up(self.table[ids])))

    model = BareTable()
    parts, trace, _, projections, _ = _through_pairs(model, jnp.zeros((2, 4), jnp.int32))
    assert {trace.path(i) for i in projections} == {"up.kernel", "down.kernel"}
    assert parts.roles[("table",)] == ("embedding", "table", 0, 50)
    assert parts.vocab == 50


def test_pairs_are_one_attention_and_one_mlp_pair_per_block():
    _, trace, _, _, groups = _through_pairs(_llama())
    rows = sorted(trace.path(g.row) for g in groups)
    assert rows == [
        f"layers.{i}.{part}"
        for i in (0, 1)
        for part in ("mlp.down_proj.kernel", "self_attn.o_proj.kernel")
    ]
    assert sorted(g.attention for g in groups) == [False, False, True, True]


def test_blocks_are_the_repeated_decoder_layers():
    blocks = find_blocks(read_parts(_llama()))
    assert [path_str(b) for b in blocks.paths] == ["layers.0", "layers.1"]
    assert (blocks.cls, blocks.period) == ("LlamaDecoderLayer", 1)
    assert blocks.of(("layers", 1, "mlp", "up_proj", "kernel")) == 1
    assert blocks.of(("lm_head",)) is None


def test_roles_name_each_pair_and_record_its_units():
    parts, trace, _, _, groups = _through_pairs(_llama())
    found = name_roles(trace, groups, parts)
    assert (found.attention, found.mlp) == ("separate", "swiglu")
    assert found.dims == {"heads": 4, "kv_heads": 2, "head_dim": 8, "hidden": 64}
    roles = parts.roles
    assert roles[("layers", 0, "self_attn", "k_proj", "kernel")] == ("k", "kernel", 1, 2)
    assert roles[("layers", 0, "self_attn", "o_proj", "kernel")] == ("o", "kernel", 0, 4)
    assert roles[("layers", 1, "mlp", "gate_proj", "kernel")] == ("gate", "kernel", 1, 64)


def test_head_and_parameter_table_come_last():
    parts, trace, blocks, projections, groups = _through_pairs(_llama())
    name_roles(trace, groups, parts)
    assert find_head(parts, blocks, True) is False  # a separate head
    assert parts.roles[("lm_head",)] == ("head", "kernel", 1, 64)
    infos, replicated = param_infos(parts, blocks, trace, projections)
    assert len(infos) == len(parts.plist) and replicated == ()
    assert {p.path: p.block for p in infos}["layers.1.mlp.up_proj.kernel"] == 1
    dots = dot_costs(trace, blocks)
    assert {d.block for d in dots if d.param and d.param.startswith("layers.1.")} == {1}
