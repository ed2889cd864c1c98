"""to_distributed on issue 27's forms (:data:`jfleet.testing.nnx_styles.FORMS`): a ViT, the
MNIST CNN, a T5-style encoder-decoder, a Mixture-of-Experts decoder, a decoder trained through
a KV cache. Attention, MLP and expert weights split over ``mp`` on their heads / hidden dim,
10 Adam steps equal one device within 1e-4 (fp32), and the plan names what it traced."""

from __future__ import annotations

import fnmatch
import functools
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jfleet import make_train_step
from jfleet.auto_parallel import (
    ToDistributedConfig,
    get_plan,
    match_patterns,
    plan_for,
    to_distributed,
)
from jfleet.testing import assert_trees_close, train_one_device
from jfleet.testing.nnx_styles import FORMS
from jfleet.testing.nnx_styles.block_forms import DropoutDecoder

STEPS = 10
TOL = 1e-4


@functools.cache
def one_device(name: str) -> tuple[float, ...]:
    form = FORMS[name]
    losses, _ = train_one_device(
        form.build(nnx.Rngs(0)), optax.adam(1e-2), form.batches(STEPS), form.loss_fn
    )
    return tuple(float(x) for x in losses)


@functools.cache
def distributed(name: str, mesh: tuple, microbatches: int | None = None):
    form = FORMS[name]
    config = ToDistributedConfig(
        force_mesh=dict(mesh), forward=form.forward, num_microbatches=microbatches
    )
    model, opt, loader = to_distributed(
        form.build(nnx.Rngs(0)), optax.adam(1e-2), form.batches(STEPS), config=config
    )
    step = make_train_step(form.loss_fn)
    losses = tuple(float(step(model, opt, batch)) for batch in loader)
    PLACED[(name, mesh)] = placed_specs(get_plan(model), model)
    return get_plan(model), losses


#: ``{(form, mesh): {plan path: spec as placed}}`` of the runs above.
PLACED: dict = {}


def placed_specs(plan, model) -> dict[str, P]:
    """Each plan path's spec as its array was placed (a stacked leaf ``<list>.body.<rest>``,
    stacked axes first, stands for ``<list>.<i>.<rest>``); all-None specs read ``P()``."""
    shapes = {p.path: p.shape for p in plan.params}
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var.get_value()
        name = ".".join(map(str, path))
        head, sep, rest = name.partition(".body.")
        targets = [t for t in shapes if sep and t.startswith(head + ".") and t.endswith("." + rest)]
        for target in targets or [name]:
            ndim = len(shapes[target])
            spec = tuple(value.sharding.spec) + (None,) * value.ndim
            spec = spec[value.ndim - ndim : value.ndim]
            out[target] = P() if all(e is None for e in spec) else P(*spec)
    return out


@pytest.mark.parametrize("name", list(FORMS))
def test_each_form_splits_its_weights_over_mp_and_trains_like_one_device(name):
    form = FORMS[name]
    plan, losses = distributed(name, (("dp", 2), ("mp", 4)))
    checked = 0
    for p in plan.params:
        (pattern,) = [s for s in form.splits if fnmatch.fnmatch(p.path, s)] or [None]
        if pattern is None:
            continue
        dim = form.splits[pattern]
        want = P(*("mp" if d == dim else None for d in range(len(form.shapes[pattern]))))
        assert (p.role, p.spec) == (form.roles[pattern], want), p.path
        checked += 1
    assert checked >= len(form.splits)
    # the plan's table is the arrays as placed (issue 27: it once showed P(None, None) for a
    # kernel placed P(None, 'mp'))
    placed = PLACED[(name, (("dp", 2), ("mp", 4)))]
    assert {p.path: p.spec for p in plan.params} == placed
    reference = one_device(name)
    assert reference[-1] < reference[0]  # the form trains, so equality means something
    np.testing.assert_allclose(losses, reference, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("name", [n for n, form in FORMS.items() if form.pipelines])
def test_forms_with_block_stacks_train_pipelined_like_one_device(name):
    plan, losses = distributed(name, (("dp", 2), ("pp", 2), ("mp", 2)), 2)
    assert plan.layout.pp == 2
    np.testing.assert_allclose(losses, one_device(name), rtol=TOL, atol=TOL)


#: What each plan must say about the model and its workload (8 samples a batch).
DESCRIBED = {
    "vit": (
        "VisionTransformer: width 32, reads images, attention separate (4 heads, 4 kv heads), "
        "mlp gelu (hidden 64), 2 x ViTBlock, head of 10 outputs",
        "images 8 x 8x8x3",
    ),
    "cnn": (
        "MnistCnn: width 64, reads images, no attention, mlp relu (hidden 64), "
        "no repeated blocks, no separate head (linear2.kernel gives the 10 outputs)",
        "images 8 x 8x8x1",
    ),
    "encoder_decoder": (
        "EncoderDecoder: width 32, vocab 48, attention separate (4 heads, 4 kv heads), "
        "mlp relu (hidden 64), 2 x T5EncoderBlock (encoder) + 2 x T5DecoderBlock (decoder), "
        "separate head",
        "batch 8 x seq 8",
    ),
}


@pytest.mark.parametrize("name", sorted(DESCRIBED))
def test_the_plan_names_the_workload_and_parts_it_traced(name):
    plan, _ = distributed(name, (("dp", 2), ("mp", 4)))
    text = str(plan).splitlines()
    model, workload = DESCRIBED[name]
    assert f"model: {model}" in text
    assert f"workload: {workload}, float32, adam" in text
    if name == "vit":  # the 10-class head stays whole at mp=4, saying why
        head = {p.path: p for p in plan.params}["head.kernel"]
        assert head.spec == P() and "does not divide its 10" in head.replicated_why
    if name == "encoder_decoder":  # the relative-position tables go with the heads
        bias = {p.path: p for p in plan.params}["encoder.0.attn.relative_attention_bias.embedding"]
        assert bias.spec == P(None, "mp") and plan.spec("shared.embedding") == P("mp", None)


def test_decoder_blocks_taking_the_encoder_output_are_refused_a_pipeline_with_the_reason():
    """The memory needs a gradient; a pipeline's block arguments get none (silently wrong)."""
    form = FORMS["encoder_decoder"]
    config = ToDistributedConfig(
        force_mesh={"dp": 2, "pp": 2, "mp": 2}, forward=form.forward, num_microbatches=2
    )
    with pytest.raises(ValueError, match="computed from the model's parameters"):
        to_distributed(form.build(nnx.Rngs(0)), optax.adam(1e-2), form.batches(2), config=config)


def dropout_run(rate: float | None, steps: int = 3):
    """The dropout form pipelined at dp2 x pp2 x mp2 over 2 micro-batches: losses, the model."""
    form = FORMS["dropout_blocks"]
    config = ToDistributedConfig(
        force_mesh={"dp": 2, "pp": 2, "mp": 2}, forward=form.forward, num_microbatches=2
    )
    model, opt, loader = to_distributed(
        DropoutDecoder(rate, rngs=nnx.Rngs(params=0, dropout=1)),
        optax.adam(1e-2),
        form.batches(steps),
        config=config,
    )
    step = make_train_step(form.loss_fn)
    return [float(step(model, opt, batch)) for batch in loader], model


def stream_counts(model: nnx.Module) -> list[int]:
    """Every RNG stream's count, a stacked stream's counts one per block, in sorted order."""
    counts = jax.tree.leaves(nnx.state(model, nnx.RngCount))
    return sorted(int(c) for a in counts for c in np.asarray(a).reshape(-1))


def test_pipelined_dropout_draws_what_the_unpipelined_model_draws_and_reruns_bit_identically():
    """Rate 0.1 inside the blocks (and after the embedding): the pipelined run equals the
    unpipelined one (one device: its draws do not depend on the mesh) to fp32 rounding, the
    masks being the same bits; a second run with the seed is bit-identical; the streams'
    counts advance as the unpipelined run's; rate 0 is the model without dropout."""
    form = FORMS["dropout_blocks"]
    reference = DropoutDecoder(0.1, rngs=nnx.Rngs(params=0, dropout=1))
    want, _ = train_one_device(reference, optax.adam(1e-2), form.batches(3), form.loss_fn)
    plain, _ = train_one_device(
        DropoutDecoder(None, rngs=nnx.Rngs(params=0, dropout=1)),
        optax.adam(1e-2),
        form.batches(3),
        form.loss_fn,
    )
    assert np.abs(np.asarray(want) - plain).max() > 1e-3  # the masks change the losses
    first, model = dropout_run(0.1)
    assert_trees_close(np.asarray(first), np.asarray(want), devices=8)
    assert stream_counts(model) == stream_counts(reference) == [3] * 7
    again, _ = dropout_run(0.1)
    assert again == first  # bit-identical
    zero, model = dropout_run(0.0)
    assert_trees_close(np.asarray(zero), np.asarray(plain), devices=8)
    assert stream_counts(model) == [0] * 7  # rate 0 draws nothing


GOLDEN = Path(__file__).parent / "golden"
#: ``golden/<form>_plan_<mesh>.txt``: the plan's description of the model, its workload and
#: every parameter's layout, written by hand from the model (not copied from a run); the
#: predicted numbers and the candidates' ranking, which the cost model moves, are left out.
PLAN_GOLDENS = {
    ("cnn", "dp2_mp4"): {"dp": 2, "mp": 4},
    ("vit", "dp2_mp4"): {"dp": 2, "mp": 4},
    ("vit", "dp2_pp2_mp2"): {"dp": 2, "pp": 2, "mp": 2},
    ("encoder_decoder", "dp2_mp4"): {"dp": 2, "mp": 4},
}


def described(text: str) -> tuple[str, list[str]]:
    """The plan's text without the predicted line and the candidates table, and the
    candidates table's rows."""
    kept, rows, in_table = [], [], False
    for line in text.splitlines():
        if line.startswith("| rank |"):
            in_table = True
            continue
        if in_table and (line.startswith("|") or line.startswith("(")):
            rows.append(line)
            continue
        in_table = False
        if not line.startswith("predicted per device:") and (line or kept[-1]):
            kept.append(line)  # one blank line where the candidates table was
    return "\n".join(kept) + "\n", rows[1:]  # the |---| line dropped


@pytest.mark.parametrize(("name", "mesh"), sorted(PLAN_GOLDENS))
def test_plan_goldens_name_the_workload_and_parts(name, mesh):
    form = FORMS[name]
    model = nnx.eval_shape(lambda: form.build(nnx.Rngs(0)))
    batch = form.batches(1)[0]
    degrees = PLAN_GOLDENS[(name, mesh)]
    plan = plan_for(
        model, device_num=8, batch_size=8, seq_len=8, force_mesh=degrees, recompute=False,
        schedule="FThenB" if "pp" in degrees else None,
        num_microbatches=2 if "pp" in degrees else None,
        patterns=match_patterns(model, batch, forward=form.forward),
    )  # fmt: skip
    text, candidates = described(str(plan))
    assert text == (GOLDEN / f"{name}_plan_{mesh}.txt").read_text()
    # a forced mesh still prints its candidates: the forced layout, chosen
    assert candidates and candidates[0].startswith(f"| 1 | {plan.layout.name} |")
    assert candidates[0].endswith("| chosen |")
