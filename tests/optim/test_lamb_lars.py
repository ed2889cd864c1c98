"""Tests for jfleet.optim.lamb_lars and jfleet.optim.hyperparams.

LAMB and LARS are checked against NumPy (float64) transcriptions of Paddle's kernels
(``phi/kernels/funcs/lamb_functors.h``, ``phi/kernels/cpu/lars_momentum_kernel.cc``).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.optim import hyperparams as hp
from jfleet.optim.gradient_merge import gradient_merge
from jfleet.optim.lamb_lars import LambState, LarsState, lamb_from, lars_from, parameter_names

RTOL = 1e-5


# ----------------------------------------------------------------------------- helpers


def _params():
    rng = np.random.default_rng(0)
    return {
        "layers": [
            {
                "linear": {
                    "kernel": rng.normal(size=(4, 3)).astype(np.float32),
                    "bias": rng.normal(size=(3,)).astype(np.float32),
                },
                "norm": {"scale": np.ones(3, np.float32)},
            }
        ],
        "head": {
            "kernel": rng.normal(size=(3, 2)).astype(np.float32),
            "bias": np.zeros(2, np.float32),  # zero norm: trust ratio falls back to 1
        },
        "zero_w": np.zeros((2, 2), np.float32),  # not excluded, zero norm
    }


def _grads(n_steps=3):
    rng = np.random.default_rng(1)
    return [
        jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), _params())
        for _ in range(n_steps)
    ]


def _names(tree):
    return dict(zip(parameter_names(tree), jax.tree.leaves(tree), strict=True))


def _f32(*xs):
    """Hyperparameters as Paddle's kernels (and inject_hyperparams) hold them: float32."""
    return [float(np.float32(x)) for x in xs]


def _np_lamb(params, grads_seq, lrs, *, b1, b2, eps, wd, excluded, always_adapt=False):
    """Paddle's lamb kernel in float64 (float32 hyperparameters), per named parameter."""
    b1, b2, eps, wd = _f32(b1, b2, eps, wd)
    lrs = _f32(*lrs)
    p = {k: v.astype(np.float64) for k, v in _names(params).items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v2 = {k: np.zeros_like(v) for k, v in p.items()}
    b1p = b2p = 1.0
    for grads, lr in zip(grads_seq, lrs, strict=True):
        b1p, b2p = b1p * b1, b2p * b2
        for k, g in _names(grads).items():
            g = g.astype(np.float64)
            rate = 0.0 if excluded(k) else wd
            m[k] = b1 * m[k] + (1 - b1) * g
            v2[k] = b2 * v2[k] + (1 - b2) * g * g
            r = (m[k] / (1 - b1p)) / (np.sqrt(v2[k] / (1 - b2p)) + eps) + rate * p[k]
            trust = 1.0
            if rate > 0 or always_adapt:
                pn, rn = np.linalg.norm(p[k]), np.linalg.norm(r)
                trust = pn / rn if pn > 0 and rn > 0 else 1.0
            p[k] = p[k] - lr * trust * r
    return p


def _np_lars(params, grads_seq, lrs, *, mu, coeff, wd, eps, excluded):
    """Paddle's CPU lars_momentum kernel in float64 (float32 hyperparameters)."""
    mu, coeff, wd, eps = _f32(mu, coeff, wd, eps)
    lrs = _f32(*lrs)
    p = {k: v.astype(np.float64) for k, v in _names(params).items()}
    vel = {k: np.zeros_like(v) for k, v in p.items()}
    for grads, lr in zip(grads_seq, lrs, strict=True):
        for k, g in _names(grads).items():
            g = g.astype(np.float64)
            rate = 0.0 if excluded(k) else wd
            pn, gn = np.linalg.norm(p[k]), np.linalg.norm(g)
            local_lr = lr
            if rate > 0 and pn > 0 and gn > 0:
                local_lr = lr * coeff * pn / (gn + rate * pn + eps)
            vel[k] = mu * vel[k] + local_lr * (g + rate * p[k])
            p[k] = p[k] - vel[k]
    return p


def _run(tx, params, grads_seq, jit=False):
    """Applies tx for len(grads_seq) steps; returns final params and summed updates."""
    params = jax.tree.map(jnp.asarray, params)
    state = tx.init(params)
    update = jax.jit(tx.update) if jit else tx.update
    total = jax.tree.map(jnp.zeros_like, params)
    for grads in grads_seq:
        updates, state = update(jax.tree.map(jnp.asarray, grads), state, params)
        total = jax.tree.map(jnp.add, total, updates)
        params = optax.apply_updates(params, updates)
    return params, total, state


def _check_against(reference, params0, params, total):
    p0 = _names(params0)
    got_p, got_total = _names(params), _names(total)
    for name, want in reference.items():
        np.testing.assert_allclose(got_p[name], want, rtol=RTOL, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(
            got_total[name], want - p0[name], rtol=RTOL, atol=1e-8, err_msg=name
        )


def _lamb_excluded(name):
    return any(name.endswith(pat) for pat in ("bias",))


def _lars_excluded(name):
    return any(pat in name for pat in ("bias",))


# ----------------------------------------------------------------------- hyperparams


def test_factories_are_inject_hyperparams_with_paddle_defaults():
    family, h = hp.inner_hyperparams(hp.adam(1e-3))
    assert family == "adam"
    got = {k: float(h[k]) for k in ("learning_rate", "b1", "b2", "eps")}
    assert got == pytest.approx({"learning_rate": 1e-3, "b1": 0.9, "b2": 0.999, "eps": 1e-8})
    family, h = hp.inner_hyperparams(hp.adamw(1e-3))
    assert family == "adamw" and float(h["weight_decay"]) == pytest.approx(0.01)
    family, h = hp.inner_hyperparams(hp.momentum(0.1))
    assert family == "momentum" and float(h["momentum"]) == pytest.approx(0.9)
    family, h = hp.inner_hyperparams(hp.sgd(0.1))
    assert family == "sgd" and set(h) == {"learning_rate"}
    state = hp.adam(1e-3).init(jnp.zeros(2))
    assert isinstance(state, optax.InjectStatefulHyperparamsState)


def test_factories_match_optax_updates():
    params = {"w": jnp.arange(3.0)}
    g = {"w": jnp.array([0.1, -0.2, 0.3])}
    for ours, ref in [
        (hp.adam(1e-2), optax.adam(1e-2)),
        (hp.adamw(1e-2), optax.adamw(1e-2, weight_decay=0.01)),
        (hp.momentum(1e-2, nesterov=True), optax.sgd(1e-2, momentum=0.9, nesterov=True)),
        (hp.sgd(1e-2), optax.sgd(1e-2)),
    ]:
        u1, _ = ours.update(g, ours.init(params), params)
        u2, _ = ref.update(g, ref.init(params), params)
        # inject_hyperparams holds b2 in float32: 1 - b2 is off by 1.3e-5, its sqrt by 6e-6.
        np.testing.assert_allclose(u1["w"], u2["w"], rtol=1e-5)


def test_optimizer_family_names():
    assert hp.optimizer_family(optax.adam(1e-3)) == "adam"
    assert hp.optimizer_family(optax.sgd(0.1, momentum=0.9)) == "momentum"
    assert hp.optimizer_family(optax.sgd(0.1)) == "sgd"
    assert hp.optimizer_family(optax.rmsprop(0.1)).startswith("other (ScaleByRms")


def test_inner_hyperparams_of_a_schedule_is_its_first_value():
    sched = optax.linear_schedule(0.5, 0.0, 10)
    family, h = hp.inner_hyperparams(optax.inject_hyperparams(optax.adam)(learning_rate=sched))
    assert family == "adam" and float(h["learning_rate"]) == pytest.approx(0.5)


# ------------------------------------------------------------------------------ LAMB


@pytest.mark.parametrize("jit", [False, True])
def test_lamb_matches_paddle_formula_over_3_steps(jit):
    params, grads = _params(), _grads()
    tx = lamb_from(hp.adam(1e-2), lamb_weight_decay=0.01, exclude_from_weight_decay=["bias"])
    new_params, total, state = _run(tx, params, grads, jit=jit)
    ref = _np_lamb(
        params, grads, [1e-2] * 3, b1=0.9, b2=0.999, eps=1e-8, wd=0.01, excluded=_lamb_excluded
    )
    _check_against(ref, params, new_params, total)
    assert isinstance(state, LambState)
    np.testing.assert_allclose(state.beta1_pow, 0.9**3, rtol=1e-6)


def test_lamb_always_adapt_and_adamw_inner():
    params, grads = _params(), _grads()
    tx = lamb_from(
        hp.adamw(2e-2, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.3),  # AdamW's wd is unused
        lamb_weight_decay=0.05,
        exclude_from_weight_decay=["bias"],
        always_adapt=True,
    )
    new_params, total, _ = _run(tx, params, grads)
    ref = _np_lamb(
        params,
        grads,
        [2e-2] * 3,
        b1=0.8,
        b2=0.99,
        eps=1e-6,
        wd=0.05,
        excluded=_lamb_excluded,
        always_adapt=True,
    )
    _check_against(ref, params, new_params, total)


def test_lamb_keeps_the_inner_schedule():
    sched = optax.piecewise_constant_schedule(0.01, {1: 0.5, 2: 0.1})
    lrs = [float(sched(t)) for t in range(3)]
    assert lrs == pytest.approx([0.01, 0.005, 0.0005])
    params, grads = _params(), _grads()
    tx = lamb_from(optax.inject_hyperparams(optax.adam)(learning_rate=sched))
    new_params, total, state = _run(tx, params, grads, jit=True)
    ref = _np_lamb(params, grads, lrs, b1=0.9, b2=0.999, eps=1e-8, wd=0.01, excluded=lambda n: 0)
    _check_against(ref, params, new_params, total)
    assert float(state.inner_state.hyperparams["learning_rate"]) == pytest.approx(lrs[-1])
    # The clock runs on a scalar stand-in: a few bytes, whatever the model size.
    assert sum(x.size for x in jax.tree.leaves(state.inner_state)) < 16


def test_lamb_manual_learning_rate_override_is_used():
    params = {"w": jnp.ones(3)}
    tx = lamb_from(hp.adam(1e-2), lamb_weight_decay=0.0)
    state = tx.init(params)
    state.inner_state.hyperparams["learning_rate"] = jnp.asarray(0.5)
    updates, _ = tx.update({"w": jnp.ones(3)}, state, params)
    np.testing.assert_allclose(updates["w"], -0.5 * np.ones(3), rtol=1e-6)


def test_lamb_excluded_bias_gets_no_weight_decay():
    params = jax.tree.map(jnp.asarray, _params())
    zero = jax.tree.map(jnp.zeros_like, params)
    tx = lamb_from(hp.adam(1e-2), exclude_from_weight_decay=["bias"])
    updates, _ = tx.update(zero, tx.init(params), params)
    named = _names(updates)
    assert not np.any(named["layers.0.linear.bias"])  # excluded: zero grad, no decay
    # Not excluded: r = wd * p, trust = ||p|| / ||wd p||: the step is -lr * p.
    np.testing.assert_allclose(
        named["layers.0.linear.kernel"], -1e-2 * params["layers"][0]["linear"]["kernel"], rtol=1e-5
    )
    np.testing.assert_allclose(named["layers.0.norm.scale"], -1e-2 * np.ones(3), rtol=1e-5)


def test_lamb_matches_by_suffix_lars_by_substring():
    params = jax.tree.map(jnp.asarray, _params())
    zero = jax.tree.map(jnp.zeros_like, params)
    lamb = lamb_from(hp.adam(1e-2), exclude_from_weight_decay=["norm", "scale"])
    with pytest.warns(UserWarning, match="'norm' matches no parameter"):
        state = lamb.init(params)
    u_lamb = _names(lamb.update(zero, state, params)[0])
    assert not np.any(u_lamb["layers.0.norm.scale"])  # ends with "scale"
    lars = lars_from(hp.momentum(0.1), exclude_from_weight_decay=["norm"])
    u_lars = _names(lars.update(zero, lars.init(params), params)[0])
    assert not np.any(u_lars["layers.0.norm.scale"])  # contains "norm"
    assert np.all(u_lars["layers.0.linear.kernel"] != 0)  # decayed


def test_explicit_param_names():
    params = {"a": jnp.ones(2), "b": jnp.ones(2)}
    tx = lamb_from(
        hp.adam(1e-2),
        exclude_from_weight_decay=["b_0"],
        param_names={"a": "linear_0.w_0", "b": "linear_0.b_0"},
    )
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zero, tx.init(params), params)
    assert np.all(updates["a"] != 0) and not np.any(updates["b"])


def test_inner_with_a_params_shaped_mask_is_checked_at_init():
    # A mask tree cannot be initialised on a scalar probe: the check waits for the params.
    inner = optax.inject_hyperparams(optax.adamw, static_args="mask")(
        learning_rate=1e-2, mask={"w": True, "b": False}
    )
    params = {"w": jnp.ones(3), "b": jnp.ones(2)}
    tx = lamb_from(inner, lamb_weight_decay=0.0)
    updates, _ = jax.jit(tx.update)(params, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -1e-2 * np.ones(3), rtol=1e-5)
    inner = optax.inject_hyperparams(optax.adamw, static_args="mask")(
        learning_rate=1e-2, mask={"w": True, "b": False}
    )
    with pytest.raises(ValueError, match="got 'adamw'"):
        lars_from(inner).init(params)


def test_parameter_names_of_nnx_state_drop_value():
    model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.LayerNorm(4, rngs=nnx.Rngs(0)))
    names = parameter_names(nnx.state(model, nnx.Param))
    assert names == ["layers.0.bias", "layers.0.kernel", "layers.1.bias", "layers.1.scale"]


def test_lamb_with_nnx_optimizer():
    model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.LayerNorm(4, rngs=nnx.Rngs(0)))
    before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    tx = lamb_from(hp.adam(1e-2), exclude_from_weight_decay=["bias", "scale"])
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
        grads = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
        opt.update(model, grads)

    step(model, opt)
    after = _names(nnx.state(model, nnx.Param))
    before = _names(before)
    for name in ("layers.0.bias", "layers.1.bias", "layers.1.scale"):
        np.testing.assert_array_equal(after[name], before[name])
    np.testing.assert_allclose(after["layers.0.kernel"], 0.99 * before["layers.0.kernel"], 1e-5)


def test_lamb_bf16_params_keep_dtype_and_fp32_moments():
    params = {"w": jnp.ones((4,), jnp.bfloat16)}
    tx = lamb_from(hp.adam(1e-2))
    state = tx.init(params)
    updates, state = jax.jit(tx.update)({"w": jnp.ones((4,), jnp.bfloat16)}, state, params)
    assert updates["w"].dtype == jnp.bfloat16
    assert state.mu["w"].dtype == jnp.float32 and state.nu["w"].dtype == jnp.float32


# ------------------------------------------------------------------------------ LARS


@pytest.mark.parametrize("jit", [False, True])
def test_lars_matches_paddle_formula_over_3_steps(jit):
    params, grads = _params(), _grads()
    tx = lars_from(
        hp.momentum(0.1, momentum=0.8),
        lars_coeff=0.02,
        lars_weight_decay=0.01,
        epsilon=1e-3,
        exclude_from_weight_decay=["bias"],
    )
    new_params, total, state = _run(tx, params, grads, jit=jit)
    ref = _np_lars(
        params, grads, [0.1] * 3, mu=0.8, coeff=0.02, wd=0.01, eps=1e-3, excluded=_lars_excluded
    )
    _check_against(ref, params, new_params, total)
    assert isinstance(state, LarsState)


def test_lars_defaults_and_schedule():
    sched = optax.exponential_decay(0.2, transition_steps=1, decay_rate=0.5)
    lrs = [float(sched(t)) for t in range(3)]
    params, grads = _params(), _grads()
    tx = lars_from(optax.inject_hyperparams(optax.sgd)(learning_rate=sched, momentum=0.9))
    new_params, total, state = _run(tx, params, grads, jit=True)
    ref = _np_lars(
        params, grads, lrs, mu=0.9, coeff=0.001, wd=0.0005, eps=0.0, excluded=lambda n: False
    )
    _check_against(ref, params, new_params, total)
    assert float(state.inner_state.hyperparams["learning_rate"]) == pytest.approx(lrs[-1])


def test_lars_excluded_bias_is_plain_momentum_without_decay():
    params = {"w": jnp.ones(2), "bias": jnp.ones(2)}
    tx = lars_from(hp.momentum(0.1), lars_weight_decay=0.5, exclude_from_weight_decay=["bias"])
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zero, tx.init(params), params)
    assert not np.any(updates["bias"])
    np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * np.ones(2), rtol=1e-6)  # lr * wd * p
    g = {"w": jnp.full(2, 2.0), "bias": jnp.full(2, 2.0)}
    updates, _ = tx.update(g, tx.init(params), params)
    np.testing.assert_allclose(updates["bias"], -0.1 * 2.0 * np.ones(2), rtol=1e-6)


# ----------------------------------------------------------------- contract: sharding etc.


def _mesh():
    return jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)


def _sharded_params(mesh):
    rng = np.random.default_rng(2)
    specs = {
        "kernel": ((8, 4), P("x", "y")),
        "bias": ((4,), P("y")),
        "emb": ((16, 8), P(("x", "y"), None)),
        "head": ((4, 2), P()),
    }
    return {
        k: jax.device_put(rng.normal(size=s).astype(np.float32), NamedSharding(mesh, spec))
        for k, (s, spec) in specs.items()
    }


def _assert_like_params(tree, params):
    for k, p in params.items():
        assert tree[k].sharding.is_equivalent_to(p.sharding, p.ndim), (k, tree[k].sharding)


@pytest.mark.parametrize(
    "make",
    [
        lambda: lamb_from(hp.adam(1e-2), exclude_from_weight_decay=["bias"]),
        lambda: lars_from(hp.momentum(0.1), exclude_from_weight_decay=["bias"]),
    ],
    ids=["lamb", "lars"],
)
def test_state_sharding_kept_on_8_devices_and_values_match_single_device(make):
    mesh = _mesh()
    params = _sharded_params(mesh)
    grads = jax.tree.map(lambda p: p * 0.1 + 0.05, params)
    tx = make()

    def slots(state):
        return [state.mu, state.nu] if isinstance(state, LambState) else [state.velocity]

    # Eager init, as nnx.Optimizer does (a jitted init needs out_shardings, as for optax).
    state = tx.init(params)
    for slot in slots(state):
        _assert_like_params(slot, params)
    updates, state1 = tx.update(grads, state, params)
    jupdates, jstate1 = jax.jit(tx.update)(grads, state, params)
    for slot in slots(state1) + slots(jstate1):
        _assert_like_params(slot, params)
    _assert_like_params(jupdates, params)

    # The same step on one device, from host copies.
    g1, p1 = (jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), t) for t in (grads, params))
    single, _ = tx.update(g1, tx.init(p1), p1)
    for k in params:
        np.testing.assert_allclose(jupdates[k], single[k], rtol=RTOL, atol=1e-8)
        np.testing.assert_allclose(updates[k], single[k], rtol=RTOL, atol=1e-8)


def test_lamb_under_gradient_merge():
    params = {"w": jnp.arange(1.0, 5.0), "bias": jnp.ones(2)}
    g1 = {"w": jnp.full(4, 0.2), "bias": jnp.full(2, -0.1)}
    g2 = {"w": jnp.full(4, 0.6), "bias": jnp.full(2, 0.3)}
    merged = gradient_merge(lamb_from(hp.adam(1e-2)), k_steps=2)
    state = merged.init(params)
    step = jax.jit(merged.update)
    u1, state = step(g1, state, params)
    u2, state = step(g2, state, params)
    direct = lamb_from(hp.adam(1e-2))
    want, _ = direct.update(
        jax.tree.map(lambda a, b: (a + b) / 2, g1, g2), direct.init(params), params
    )
    assert not np.any(u1["w"]) and not np.any(u1["bias"])
    for k in params:
        np.testing.assert_allclose(u2[k], want[k], rtol=1e-6)


# ------------------------------------------------------------------------- bad inputs


def _adam():
    return hp.adam(1e-3)


BAD = [
    ("lamb over sgd", lambda: lamb_from(hp.sgd(0.1)), ValueError, "got 'sgd'"),
    ("lamb over momentum", lambda: lamb_from(hp.momentum(0.1)), ValueError, "got 'momentum'"),
    ("lars over adam", lambda: lars_from(_adam()), ValueError, "got 'adam'"),
    ("lars over sgd", lambda: lars_from(hp.sgd(0.1)), ValueError, "got 'sgd'"),
    (
        "plain optax.adam",
        lambda: lamb_from(optax.adam(1e-3)),
        ValueError,
        "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)",
    ),
    (
        "plain optax.sgd momentum",
        lambda: lars_from(optax.sgd(0.1, momentum=0.9)),
        ValueError,
        "optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)",
    ),
    (
        "chain around the wrapped optimizer",
        lambda: lamb_from(optax.chain(optax.clip(1.0), _adam())),
        ValueError,
        "inject_hyperparams-wrapped optimizer itself",
    ),
    (
        "pattern is a bare string",
        lambda: lamb_from(_adam(), exclude_from_weight_decay="bias"),
        TypeError,
        "exclude_from_weight_decay='bias'",
    ),
    (
        "pattern of wrong type",
        lambda: lars_from(hp.momentum(0.1), exclude_from_weight_decay=[3]),
        TypeError,
        "[3]",
    ),
    (
        "empty pattern",
        lambda: lamb_from(_adam(), exclude_from_weight_decay=["bias", ""]),
        TypeError,
        "['']",
    ),
    (
        "pattern not a sequence",
        lambda: lamb_from(_adam(), exclude_from_weight_decay=5),
        TypeError,
        "exclude_from_weight_decay=5",
    ),
    (
        "negative lamb weight decay",
        lambda: lamb_from(_adam(), lamb_weight_decay=-0.01),
        ValueError,
        "lamb_weight_decay=-0.01",
    ),
    (
        "nan lars weight decay",
        lambda: lars_from(hp.momentum(0.1), lars_weight_decay=float("nan")),
        ValueError,
        "lars_weight_decay=nan",
    ),
    (
        "negative lars epsilon",
        lambda: lars_from(hp.momentum(0.1), epsilon=-1.0),
        ValueError,
        "epsilon=-1.0",
    ),
    (
        "negative lars coeff",
        lambda: lars_from(hp.momentum(0.1), lars_coeff=-0.001),
        ValueError,
        "lars_coeff=-0.001",
    ),
    (
        "bool weight decay",
        lambda: lamb_from(_adam(), lamb_weight_decay=True),
        TypeError,
        "lamb_weight_decay=True",
    ),
    (
        "always_adapt not a bool",
        lambda: lamb_from(_adam(), always_adapt="yes"),
        TypeError,
        "always_adapt='yes'",
    ),
    ("adam b1 out of range", lambda: hp.adam(1e-3, b1=1.0), ValueError, "b1=1.0"),
    ("negative learning rate", lambda: hp.sgd(-0.1), ValueError, "learning_rate=-0.1"),
    ("momentum as string", lambda: hp.momentum(0.1, momentum="0.9"), TypeError, "momentum='0.9'"),
]


@pytest.mark.parametrize("make,error,text", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_inputs_say_what_was_given(make, error, text):
    with pytest.raises(error, match=re.escape(text)):
        make()


def test_bad_param_names_and_missing_params():
    params = {"a": jnp.ones(2), "b": jnp.ones(2)}
    tx = lamb_from(_adam(), param_names={"a": "x"})
    with pytest.raises(ValueError, match=r"one str per parameter leaf \(2 leaves\), got 1"):
        tx.init(params)
    tx = lars_from(hp.momentum(0.1))
    with pytest.raises(ValueError, match="LARS needs params"):
        tx.update(params, tx.init(params))
