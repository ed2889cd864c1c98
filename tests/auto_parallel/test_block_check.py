"""jfleet.auto_parallel.match.block_check: the reasons a model's blocks cannot be pipelined,
found at planning time by an abstract trace that leaves the model as it was."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jfleet.auto_parallel.match import block_calls, block_check
from tests.parallel.test_stack import TOKENS, WIDTH, Block, Decoder

PATHS = [f"layers.{i}" for i in range(4)]


def tokens(batch: int = 4):
    return jnp.zeros((batch, TOKENS), jnp.int32)


# ------------------------------------------------------------------ variants of the decoder
class DropoutBlock(Block):
    """Holds its own dropout RNG stream (state other than nnx.Param)."""

    def __init__(self, i, *, rngs):
        super().__init__(i, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x, positions):
        return self.drop(super().__call__(x, positions))


class DropoutDecoder(Decoder):
    block_class = DropoutBlock


class AuxBlock(Block):
    """Returns (hidden, aux_loss), as mixture-of-experts blocks do."""

    def __call__(self, x, positions):
        y = super().__call__(x, positions)
        return y, jnp.mean(y**2)


class AuxDecoder(Decoder):
    block_class = AuxBlock

    def __call__(self, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x, total = self.embed(tokens), 0.0
        for layer in self.layers:
            x, aux = layer(x, positions)
            total = total + aux
        return self.embed.attend(self.norm(x)), total


class AuxListDecoder(AuxDecoder):
    """Keeps each block's auxiliary loss apart: a pipeline cannot return them one by one."""

    def __call__(self, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x, losses = self.embed(tokens), []
        for layer in self.layers:
            x, aux = layer(x, positions)
            losses.append(aux)
        return self.embed.attend(self.norm(x)), losses


class HiddenStatesDecoder(Decoder):
    """Sums every block's hidden state into its output: a pipeline returns only the last."""

    def __call__(self, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embed(tokens)
        states = []
        for layer in self.layers:
            x = layer(x, positions)
            states.append(x)
        return self.embed.attend(self.norm(sum(states)))


class CacheOutBlock(Block):
    """Returns (cache, hidden) as decoding ports do; training drops the cache."""

    def __call__(self, x, positions):
        y = super().__call__(x, positions)
        return {"k": 2 * x, "v": 3 * x}, y


class CacheOutDecoder(Decoder):
    block_class = CacheOutBlock

    def __call__(self, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embed(tokens)
        for layer in self.layers:
            _, x = layer(x, positions)
        return self.embed.attend(self.norm(x))


class KeyOutBlock(Block):
    """Returns a PRNG key beside the hidden state: no array a pipeline can carry."""

    def __call__(self, x, positions):
        return super().__call__(x, positions), jax.random.key(0)


class KeyOutDecoder(Decoder):
    block_class = KeyOutBlock

    def __call__(self, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embed(tokens)
        for layer in self.layers:
            x, _ = layer(x, positions)
        return x


class StatsBlock(Block):
    """Holds a batch statistic (state other than nnx.Param and RNG streams)."""

    def __init__(self, i, *, rngs):
        super().__init__(i, rngs=rngs)
        self.seen = nnx.BatchStat(jnp.zeros(()))


class StatsDecoder(Decoder):
    block_class = StatsBlock


class ShiftingBlock(Block):
    """Takes (hidden, positions) and returns the positions shifted: they do not pass back."""

    def __call__(self, inputs):
        x, positions = inputs
        return super().__call__(x, positions), positions + 1


class ShiftingDecoder(Decoder):
    block_class = ShiftingBlock

    def __call__(self, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = (self.embed(tokens), positions)
        for layer in self.layers:
            x = layer(x)
        return self.embed.attend(self.norm(x[0]))


class KVCache(nnx.Module):
    def __init__(self):
        self.keys = nnx.Cache(jnp.zeros((4, TOKENS, WIDTH)))


class CacheBlock(Block):
    def __call__(self, x, positions, cache=None):
        return super().__call__(x, positions)


class CacheDecoder(Decoder):
    """Passes a KV-cache module to every block, and a dict of arrays (which is fine)."""

    block_class = CacheBlock

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.cache = KVCache()

    def __call__(self, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, positions, cache=self.cache)
        return x


class DictArgumentDecoder(CacheDecoder):
    def __call__(self, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, positions, cache={"keys": self.cache.keys[...]})
        return x


class SkippingDecoder(Decoder):
    """Runs only the first three blocks."""

    def __call__(self, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embed(tokens)
        for layer in list(self.layers)[:3]:
            x = layer(x, positions)
        return x


class RepeatingDecoder(Decoder):
    """Runs every block twice (a looped / weight-shared stack)."""

    def __call__(self, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embed(tokens)
        for _ in range(2):
            for layer in self.layers:
                x = layer(x, positions)
        return x


class MaskDecoder(Decoder):
    """Global blocks (alike) handed a local mask on even and a causal one on odd layers, by
    layer index: without the argument check block 0's mask would reach every block."""

    def __init__(self):
        super().__init__(kinds=(1, 1, 1, 1))

    def __call__(self, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embed(tokens)
        causal = jnp.tril(jnp.ones((tokens.shape[0], TOKENS, TOKENS), bool))
        local = causal & ~jnp.tril(causal, -3)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, mask=local if i % 2 == 0 else causal)
        return x


class ScalingDecoder(Decoder):
    """Scales the activation between blocks: the blocks are not back to back."""

    def __call__(self, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embed(tokens)
        for layer in self.layers:
            x = 2 * layer(x, positions)
        return x


CASES = {
    "state": (
        StatsDecoder,
        {},
        r"state other than nnx.Param: layers\.0\.seen \(BatchStat\), layers\.1\.seen",
    ),
    "no-period": (
        lambda: Decoder(kinds=(0, 1, 1, 1)),
        {},
        r"block layers\.1 differs from block layers\.0 in attribute 'attn\.sliding_window' "
        r"\(None vs 3\), and the 4 blocks do not repeat",
    ),
    "stages": (
        Decoder,
        {"num_stages": 4},
        r"repeat every 2 .* 2 super-blocks of 2, fewer than the 4 pipeline stages",
    ),
    "aux-kept-apart": (
        AuxListDecoder,
        {},
        r"block layers\.0 returns \(float32\[4,8,16\], float32\[\]\), and its output part 1 "
        r"\(float32\[\]\) reaches the forward's output other than through the next block or "
        r"a running sum",
    ),
    "key-output": (
        KeyOutDecoder,
        {},
        r"block layers\.0 returns a tuple \(float32\[4,8,16\], key<fry>\) where it takes "
        r"float32\[4,8,16\] — only the activation",
    ),
    "hidden-states": (
        HiddenStatesDecoder,
        {},
        r"block layers\.0 returns float32\[4,8,16\], and its output part 0 \(float32\[4,8,16\]\) "
        r"reaches the forward's output other than through the next block",
    ),
    "changed-int": (
        ShiftingDecoder,
        {},
        r"block layers\.0 returns the int32\[4,8\] part 1 of its activation changed",
    ),
    "cache-argument": (
        CacheDecoder,
        {},
        r"block layers\.0 takes keyword argument 'cache' = KVCache \(an NNX object\)",
    ),
    "never-called": (SkippingDecoder, {}, r"block layers\.3 is never called by the forward"),
    "called-twice": (RepeatingDecoder, {}, r"block layers\.0 is called 2 times per forward"),
    "other-arguments": (
        MaskDecoder,
        {},
        r"block layers\.1 is called with arguments other than block layers\.0's \(keyword "
        r"argument 'mask': another array \(bool\[4,8,8\]\)\)",
    ),
    "not-back-to-back": (
        ScalingDecoder,
        {},
        r"block layers\.1 does not take the previous block's output",
    ),
}


def values(model):
    def plain(a):
        return np.asarray(
            jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a
        )

    return jax.tree.map(plain, nnx.to_pure_dict(nnx.state(model)))


def snapshot(model):
    blocks = list(model.layers)
    state = values(model)
    return blocks, [type(b) for b in blocks], nnx.graphdef(model), state


def assert_unchanged(model, before):
    blocks, classes, graphdef, state = before
    assert all(a is b for a, b in zip(model.layers, blocks, strict=True))
    assert [type(b) for b in model.layers] == classes
    assert nnx.graphdef(model) == graphdef
    jax.tree.map(np.testing.assert_array_equal, values(model), state)


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_problem_names_the_reason_and_leaves_the_model_alone(case):
    make, options, reason = CASES[case]
    model = make()
    before = snapshot(model)
    problem = block_check.pipeline_problem(model, PATHS, lambda: model(tokens()), **options)
    assert problem is not None and re.search(reason, problem), problem
    assert_unchanged(model, before)


@pytest.mark.parametrize(
    "make", [Decoder, DictArgumentDecoder, DropoutDecoder, AuxDecoder, CacheOutDecoder]
)
def test_pipeline_problem_passes_alternating_blocks_and_array_dicts(make):
    model = make()
    before = snapshot(model)
    assert block_check.pipeline_problem(model, PATHS, lambda: model(tokens()), num_stages=2) is None
    assert_unchanged(model, before)


def test_record_block_calls_sees_each_call_and_restores_a_stateful_forward():
    """The dropout blocks advance their RNG counts in the forward: the trace runs on a copy."""
    model = DropoutDecoder()
    before = snapshot(model)
    records = block_calls.record_block_calls(model, PATHS, lambda: model(tokens()))
    assert [r.path for r in records] == PATHS and all(len(r.calls) == 1 for r in records)
    call = records[2].calls[0]
    assert call.activation == (block_calls.Leaf("float", "float32[4,8,16]"),)
    assert call.arguments == (block_calls.Argument("0", block_calls.ARRAY, "int32[4,8]"),)
    assert call.returns == "array" and call.same_structure and call.chained
    assert call.differs is None
    assert_unchanged(model, before)

    shifting = ShiftingDecoder()
    (call,) = block_calls.record_block_calls(shifting, ["layers.0"], lambda: shifting(tokens()))[
        0
    ].calls
    assert [leaf.kind for leaf in call.outputs] == ["float", "int"]
    assert [leaf.passed_back for leaf in call.outputs] == [False, False]
    with pytest.raises(ValueError, match=r"block path 'layers\.9' does not resolve"):
        block_calls.record_block_calls(shifting, ["layers.9"], lambda: None)
    with pytest.raises(TypeError, match=r"block_paths='layers\.0' is one string"):
        block_calls.record_block_calls(shifting, "layers.0", lambda: None)


def test_period_problem_and_the_shared_block_period():
    from jfleet.parallel import stack

    assert block_check.block_period is stack.block_period
    blocks = list(Decoder().layers)
    assert block_check.period_problem(blocks, num_stages=2) == (2, None)
    period, reason = block_check.period_problem(blocks[:3])
    assert period is None and "block 1 differs from block 0" in reason
    three = list(Decoder(kinds=(0, 0, 0)).layers)
    assert block_check.period_problem(three, num_stages=2) == (1, None)  # uneven: 2 and 1
    assert block_check.period_problem(three, num_stages=4) == (
        1,
        "the 3 blocks are fewer than the 4 pipeline stages (every stage needs one); use pp <= 3.",
    )


def test_block_outputs_get_their_roles_from_the_dataflow_and_scan_as_they_pipeline():
    """The activation handed on, a loss summed over the blocks, a cache nobody reads: such
    outputs pipeline and scan (the stack carries them by role, issue 35); RNG streams
    pipeline but keep the blocks out of a scan."""
    roles = {}
    for make in (AuxDecoder, CacheOutDecoder, AuxListDecoder, DropoutDecoder):
        model = make()
        records = block_calls.record_block_calls(model, PATHS, lambda m=model: m(tokens()))
        roles[make.__name__] = {r.calls[0].roles for r in records}
        pipeline, scan = block_check.block_problems(model, PATHS, lambda m=model: m(tokens()))
        if make is DropoutDecoder:
            assert pipeline is None and "RngKey" in scan, scan
        elif make is not AuxListDecoder:
            assert (pipeline, scan) == (None, None), make
    A, S, D, U = block_calls.ACTIVATION, block_calls.SUM, block_calls.DROPPED, block_calls.USED
    assert roles["AuxDecoder"] == {(A, S)}
    assert roles["CacheOutDecoder"] == {(D, D, A)}  # dict leaves k, v, then the hidden state
    assert roles["AuxListDecoder"] == {(A, U)}
    assert roles["DropoutDecoder"] == {(A,) * 1}
    first = block_calls.record_block_calls(AuxDecoder(), PATHS, lambda: None)
    assert all(not r.calls for r in first)
