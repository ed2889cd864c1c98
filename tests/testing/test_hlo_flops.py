"""``hlo.dot_flops``: dot and convolution FLOPs of a compiled program, weighted by loop trips."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.testing import hlo

MATMUL = 2 * 8 * 16 * 4  # (8, 16) @ (16, 4)

ENTRY_DOT = """
HloModule m
ENTRY %main (a: f32[8,16], b: f32[16,4]) -> f32[8,4] {
  %a = f32[8,16]{1,0} parameter(0)
  %b = f32[16,4]{1,0} parameter(1)
  ROOT %d = f32[8,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""

FUSED_DOT = """
HloModule m
%fused (p0: f32[8,16], p1: f32[16,4]) -> f32[8,4] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[16,4]{1,0} parameter(1)
  ROOT %d = f32[8,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[8,16], b: f32[16,4]) -> f32[8,4] {
  %a = f32[8,16]{1,0} parameter(0)
  %b = f32[16,4]{1,0} parameter(1)
  ROOT %f = f32[8,4]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused
}
"""


def while_loop(trip_config: str, body_extra: str = "", extra_computations: str = "") -> str:
    """A while loop whose body multiplies (8, 16) by a (16, 16) weight once per trip."""
    return f"""
HloModule m
{extra_computations}
%body (t: (s32[], f32[8,16], f32[16,16])) -> (s32[], f32[8,16], f32[16,16]) {{
  %t = (s32[], f32[8,16]{{1,0}}, f32[16,16]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8,16]{{1,0}} get-tuple-element(%t), index=1
  %w = f32[16,16]{{1,0}} get-tuple-element(%t), index=2
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %y = f32[8,16]{{1,0}} dot(%x, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  {body_extra}
  ROOT %r = (s32[], f32[8,16]{{1,0}}, f32[16,16]{{1,0}}) tuple(%next, %y, %w)
}}

%cond (t: (s32[], f32[8,16], f32[16,16])) -> pred[] {{
  %t = (s32[], f32[8,16]{{1,0}}, f32[16,16]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}}

ENTRY %main (x: f32[8,16], w: f32[16,16]) -> f32[8,16] {{
  %x = f32[8,16]{{1,0}} parameter(0)
  %w = f32[16,16]{{1,0}} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{{1,0}}, f32[16,16]{{1,0}}) tuple(%zero, %x, %w)
  %loop = (s32[], f32[8,16]{{1,0}}, f32[16,16]{{1,0}}) while(%init), condition=%cond, body=%body{trip_config}
  ROOT %out = f32[8,16]{{1,0}} get-tuple-element(%loop), index=1
}}
"""  # noqa: E501


SQUARE = 2 * 8 * 16 * 16  # (8, 16) @ (16, 16)
KNOWN_5 = ', backend_config={"known_trip_count":{"n":"5"}}'


def test_dot_in_the_entry():
    assert hlo.dot_flops(ENTRY_DOT) == MATMUL
    assert hlo.contractions(ENTRY_DOT) == [
        hlo.Contraction(opcode="dot", name="d", flops=MATMUL, weight=1)
    ]


def test_dot_inside_a_fusion():
    assert hlo.dot_flops(FUSED_DOT) == MATMUL


def test_dot_inside_a_while_body_counts_each_trip():
    assert hlo.dot_flops(while_loop(KNOWN_5)) == 5 * SQUARE
    (dot,) = hlo.contractions(while_loop(KNOWN_5))
    assert (dot.weight, dot.trip_count_known) == (5, True)


def test_while_without_known_trip_count_counts_its_body_once_and_says_so():
    (dot,) = hlo.contractions(while_loop(""))
    assert (dot.weight, dot.trip_count_known) == (1, False)
    assert hlo.dot_flops(while_loop("")) == SQUARE


def test_fusion_and_call_inside_a_while_body():
    extra = """
%fused (p0: f32[8,16], p1: f32[16,16]) -> f32[8,16] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[16,16]{1,0} parameter(1)
  ROOT %d = f32[8,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%callee (q0: f32[8,16], q1: f32[16,16]) -> f32[8,16] {
  %q0 = f32[8,16]{1,0} parameter(0)
  %q1 = f32[16,16]{1,0} parameter(1)
  ROOT %d = f32[8,16]{1,0} dot(%q0, %q1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    body = (
        "%f = f32[8,16]{1,0} fusion(%x, %w), kind=kLoop, calls=%fused\n"
        "  %c = f32[8,16]{1,0} call(%x, %w), to_apply=%callee"
    )
    assert hlo.dot_flops(while_loop(KNOWN_5, body, extra)) == 3 * 5 * SQUARE


def test_nested_while_loops_multiply_trip_counts():
    # the outer loop (3 trips) runs a dot and, through a call, the whole 5-trip loop
    inner = while_loop(KNOWN_5).replace("HloModule m", "")
    inner = inner.replace("%body", "%inner_body").replace("%cond", "%inner_cond")
    inner = inner.replace("ENTRY %main", "%inner_loop")
    outer = while_loop(
        ', backend_config={"known_trip_count":{"n":"3"}}',
        body_extra="%z = f32[8,16]{1,0} call(%x, %w), to_apply=%inner_loop",
        extra_computations=inner,
    )
    assert hlo.dot_flops(outer) == 3 * SQUARE + 3 * 5 * SQUARE
    weights = sorted(c.weight for c in hlo.contractions(outer))
    assert weights == [3, 15]


def test_batch_dot_counts_batch_dims_once():
    text = """
HloModule m
ENTRY %main (a: f32[3,8,16], b: f32[3,16,4]) -> f32[3,8,4] {
  %a = f32[3,8,16]{2,1,0} parameter(0)
  %b = f32[3,16,4]{2,1,0} parameter(1)
  ROOT %d = f32[3,8,4]{2,1,0} dot(%a, %b), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}
"""  # noqa: E501
    assert hlo.dot_flops(text) == 2 * 3 * 8 * 4 * 16


def test_operand_shapes_printed_inline():
    text = """
HloModule m
ENTRY %main (a: f32[8,16], b: f32[16,4]) -> f32[8,4] {
  ROOT %d = f32[8,4]{1,0} dot(f32[8,16]{1,0} %a, f32[16,4]{1,0} %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""  # noqa: E501
    assert hlo.dot_flops(text) == MATMUL


def test_every_branch_of_a_conditional_counts_once():
    text = """
HloModule m
%left (p: f32[8,16]) -> f32[8,4] {
  %p = f32[8,16]{1,0} parameter(0)
  %w = f32[16,4]{1,0} constant({...})
  ROOT %d = f32[8,4]{1,0} dot(%p, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%right (q: f32[8,16]) -> f32[8,4] {
  %q = f32[8,16]{1,0} parameter(0)
  %v = f32[16,4]{1,0} constant({...})
  ROOT %e = f32[8,4]{1,0} dot(%q, %v), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (i: s32[], x: f32[8,16]) -> f32[8,4] {
  %i = s32[] parameter(0)
  %x = f32[8,16]{1,0} parameter(1)
  ROOT %c = f32[8,4]{1,0} conditional(%i, %x, %x), branch_computations={%left, %right}
}
"""
    assert hlo.dot_flops(text) == 2 * MATMUL  # an upper bound: one branch runs


def test_conditionals_list_each_branch_and_executed_flops_weight_them():
    # a 5-trip loop whose body runs a pred conditional: a dot when true, nothing when false
    extra = """
%work (p: f32[8,16], w: f32[16,16]) -> f32[8,16] {
  %p = f32[8,16]{1,0} parameter(0)
  %w = f32[16,16]{1,0} parameter(1)
  ROOT %d = f32[8,16]{1,0} dot(%p, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%idle (q: f32[8,16], v: f32[16,16]) -> f32[8,16] {
  %q = f32[8,16]{1,0} parameter(0)
  ROOT %c = f32[8,16]{1,0} copy(%q)
}
"""
    body = (
        "%b = pred[] compare(%i, %one), direction=LT\n"
        "  %k = f32[8,16]{1,0} conditional(%b, %x, %w, %x, %w), true_computation=%work, "
        "false_computation=%idle"
    )
    text = while_loop(KNOWN_5, body, extra)
    (cond,) = hlo.conditionals(text)
    assert (cond.weight, cond.branch_flops) == (5, (0, SQUARE))  # lax.cond order: false, true
    assert hlo.unconditional_flops(text) == 5 * SQUARE  # the body's own dot
    assert hlo.dot_flops(text) == 10 * SQUARE  # every branch, every trip: an upper bound
    assert hlo.executed_flops(text, lambda c: (3, 2)) == 7 * SQUARE
    with pytest.raises(ValueError, match=r"'k' runs 5 times with 2 branches.*adding up to 5"):
        hlo.executed_flops(text, lambda c: (1, 1))


def test_a_switch_lists_its_branches_in_index_order():
    text = """
HloModule m
%none (p: f32[8,16]) -> f32[8,4] {
  %p = f32[8,16]{1,0} parameter(0)
  ROOT %z = f32[8,4]{1,0} constant({...})
}

%right (q: f32[8,16]) -> f32[8,4] {
  %q = f32[8,16]{1,0} parameter(0)
  %v = f32[16,4]{1,0} constant({...})
  ROOT %e = f32[8,4]{1,0} dot(%q, %v), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (i: s32[], x: f32[8,16]) -> f32[8,4] {
  %i = s32[] parameter(0)
  %x = f32[8,16]{1,0} parameter(1)
  ROOT %c = f32[8,4]{1,0} conditional(%i, %x, %x, %x), branch_computations={%none, %right, %none}
}
"""
    (cond,) = hlo.conditionals(text)
    assert cond.branch_flops == (0, MATMUL, 0)
    assert hlo.executed_flops(text, lambda c: (0, 0, 1)) == 0


def test_compiled_cond_in_a_scan_executes_only_the_taken_ticks():
    w = jnp.ones((16, 16))

    def f(x):
        def tick(x, t):
            return jax.lax.cond(t < 2, lambda x: jnp.tanh(x @ w), lambda x: x, x), None

        return jax.lax.scan(tick, x, jnp.arange(6))[0]

    text = jax.jit(f).lower(jnp.ones((8, 16))).compile().as_text()
    (cond,) = hlo.conditionals(text)
    assert cond.weight == 6 and sorted(cond.branch_flops) == [0, SQUARE]
    taken = cond.branch_flops.index(SQUARE)
    assert hlo.executed_flops(text, lambda c: (4, 2) if taken else (2, 4)) == 2 * SQUARE


@pytest.mark.parametrize(
    ("labels", "kernel"),
    [("b01f_01io->b01f", "f32[3,3,3,16]{3,2,1,0}"), ("bf01_oi01->bf01", "f32[16,3,3,3]{3,2,1,0}")],
)
def test_convolution_reads_the_kernels_output_features_from_dim_labels(labels, kernel):
    out = "f32[2,8,8,16]{3,2,1,0}" if labels.startswith("b01f") else "f32[2,16,8,8]{3,2,1,0}"
    text = f"""
HloModule m
ENTRY %main (x: f32[2,8,8,3], w: f32[3,3,3,16]) -> f32[2,8,8,16] {{
  %x = f32[2,8,8,3]{{3,2,1,0}} parameter(0)
  %w = {kernel} parameter(1)
  ROOT %c = {out} convolution(%x, %w), window={{size=3x3 pad=1_1x1_1}}, dim_labels={labels}
}}
"""
    assert hlo.dot_flops(text) == 2 * (2 * 8 * 8 * 16) * (3 * 3 * 3)


def test_unreadable_lhs_shape_is_an_error_naming_the_dot():
    text = ENTRY_DOT.replace("%a = f32[8,16]{1,0} parameter(0)\n", "")
    with pytest.raises(ValueError, match="dot 'd'"):
        hlo.dot_flops(text)


# Compiled programs


def compiled(f, *args):
    return jax.jit(f).lower(*args).compile()


def test_compiled_matmul_is_exact():
    program = compiled(jnp.matmul, jnp.ones((8, 16)), jnp.ones((16, 4)))
    assert hlo.dot_flops(program.as_text()) == MATMUL


def test_compiled_scan_counts_every_step_unlike_cost_analysis():
    def scan(x, ws):
        return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0]

    program = compiled(scan, jnp.ones((8, 16)), jnp.ones((6, 16, 16)))
    assert hlo.dot_flops(program.as_text()) == 6 * SQUARE
    # XLA's own count covers the loop body once (one matmul plus elementwise work)
    assert program.cost_analysis()["flops"] < hlo.dot_flops(program.as_text())


def test_compiled_gradient_is_three_matmuls():
    def loss(a, b):
        return jnp.sum((a @ b) ** 2)  # the backward pass needs the forward product

    program = compiled(jax.grad(loss, argnums=(0, 1)), jnp.ones((8, 16)), jnp.ones((16, 4)))
    assert hlo.dot_flops(program.as_text()) == 3 * MATMUL


def test_compiled_convolution():
    def conv(x, w):
        return jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    program = compiled(conv, jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 16)))
    flops = hlo.dot_flops(program.as_text())
    assert flops == 2 * (2 * 8 * 8 * 16) * (3 * 3 * 3)
    # cost analysis leaves out the taps that fall in the padding
    assert program.cost_analysis()["flops"] <= flops


def test_compiled_sharded_matmul_is_per_device():
    mesh = jax.make_mesh((8,), ("dp",))
    a = jax.device_put(jnp.ones((64, 16)), NamedSharding(mesh, P("dp")))
    program = compiled(jnp.matmul, a, jnp.ones((16, 4)))
    assert hlo.dot_flops(program.as_text()) == MATMUL  # 64 rows over 8 devices: 8 each
