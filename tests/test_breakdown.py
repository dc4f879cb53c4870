"""k3jax.aot.breakdown: FLOPs / bytes of a compiled program attributed to named parts, with trip counts."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from k3jax.aot import analytic
from k3jax.aot import breakdown as bd
from k3jax.aot import hlo_text

M, K, N = 48, 40, 24


def _compile(fn, *args):
    return bd.breakdown(jax.jit(fn).lower(*args).compile().as_text())


def _args():
    kx, kw = jax.random.split(jax.random.key(0))
    return jax.random.normal(kx, (M, K)), jax.random.normal(kw, (K, N))


def test_matmul_counted_and_doubled_matmul_doubled():
    def one(x, w):
        with jax.named_scope("dense_ffn"):
            return jnp.tanh(x @ w)

    def two(x, w):
        with jax.named_scope("dense_ffn"):
            return jnp.tanh(x @ w) + jnp.tanh(jnp.sin(x) @ w)

    b1, b2 = _compile(one, *_args()), _compile(two, *_args())
    assert b1.flops[("dense_ffn", "forward")] == 2 * M * K * N
    assert b2.flops[("dense_ffn", "forward")] == 2 * b1.flops[("dense_ffn", "forward")]
    assert b1.attributed_share == 1.0


def test_loop_trip_counts_multiply():
    def looped(x, w):
        def outer(c, _):
            def inner(i, c):
                with jax.named_scope("kda"):
                    return jnp.tanh(c @ w @ w.T)
            return jax.lax.fori_loop(0, 3, inner, c), None
        return jax.lax.scan(outer, x, None, length=5)[0]

    b = _compile(looped, *_args())
    assert b.flops[("kda", "forward")] == 5 * 3 * 2 * (2 * M * K * N)


def test_data_dependent_loops_count_as_told():
    """A while loop whose trip count is in the data (the dropless exchange's overflow rounds) is found
    and counted ``data_dependent_trips`` times (once by default); a loop of static count is unaffected."""
    def looped(x, w, n):
        with jax.named_scope("kda"):
            y = jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ w @ w.T), x)  # static: 3 trips
        with jax.named_scope("routed_experts"):
            return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w @ w.T)), (0, y))[1]

    text = jax.jit(looped).lower(*_args(), jnp.int32(2)).compile().as_text()
    once, never, twice = (bd.breakdown(text, trips) for trips in (1, 0, 2))
    body = 2 * (2 * M * K * N)
    assert once.data_dependent_loops == 1
    assert once.flops[("routed_experts", "forward")] == body
    assert never.flops.get(("routed_experts", "forward"), 0.0) == 0.0
    assert twice.flops[("routed_experts", "forward")] == 2 * body
    assert once.flops[("kda", "forward")] == never.flops[("kda", "forward")] == 3 * body
    assert _compile(lambda x, w: x @ w, *_args()).data_dependent_loops == 0


def test_phases_forward_backward_recompute():
    def loss(x, w, remat):
        def f(x, w):
            with jax.named_scope("mla"):
                return jnp.sum(jnp.tanh(x @ w))
        return (jax.checkpoint(f) if remat else f)(x, w)

    x, w = _args()
    plain = _compile(jax.grad(lambda x, w: loss(x, w, False), argnums=(0, 1)), x, w)
    assert plain.flops[("mla", "forward")] == 2 * M * K * N
    assert plain.flops[("mla", "backward")] == 2 * (2 * M * K * N)  # dx and dw
    remat = _compile(jax.grad(lambda x, w: loss(x, w, True), argnums=(0, 1)), x, w)
    assert remat.flops[("mla", "recompute")] == 2 * M * K * N
    assert remat.flops[("mla", "backward")] == 2 * (2 * M * K * N)


def test_tpu_convolution_and_kernel_text():
    """TPU HLO writes a batched dot as a convolution whose batch window has lhs_dilate = its size
    (one real tap per output), and a Pallas kernel as a custom call carrying its CostEstimate."""
    hlo = """HloModule m

ENTRY %main (p0: bf16[8,64,32], p1: bf16[8,32,16]) -> bf16[8,64,16] {
  %p0 = bf16[8,64,32]{2,1,0} parameter(0)
  %p1 = bf16[8,32,16]{2,1,0} parameter(1)
  %convolution.1 = bf16[8,64,16]{2,1,0} convolution(%p0, %p1), window={size=8 pad=7_7 lhs_dilate=8}, dim_labels=0bf_0io->0bf, metadata={op_name="jit(f)/routed_experts/dot_general"}
  %custom-call.2 = bf16[64,16]{1,0} custom-call(%p0, %p1), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "x", "cost_estimate": {"flops": 12345, "transcendentals": 0, "bytes_accessed": 1}}}, metadata={op_name="jit(f)/transpose(jvp(routed_experts))/pallas_call"}
  ROOT %all-gather.3 = bf16[8,64,16]{2,1,0} all-gather(%convolution.1), replica_groups={{0,1,2,3}}, dimensions={0}, metadata={op_name="jit(f)/kda/all_gather"}
}
"""
    b = bd.breakdown(hlo)
    assert b.flops[("routed_experts", "forward")] == 2 * 8 * 64 * 16 * 32
    assert b.flops[("routed_experts", "backward")] == 12345
    assert b.collective_bytes["all-gather"] == pytest.approx(8 * 64 * 16 * 2 * 3 / 4)
    assert b.collective_by_part["kda"] == b.collective_bytes["all-gather"]


def test_a_conditional_counts_its_costliest_branch():
    """``lax.cond`` runs one branch: count the costlier (an upper bound), not both (two matmuls, not
    three or four)."""
    x = jnp.ones((8, 16))
    w = jnp.ones((16, 32))

    def f(x, w, pred):
        with jax.named_scope("mla"):
            return jax.lax.cond(pred, lambda: (x @ w) @ w.T, lambda: jnp.tanh(x @ w) @ w[:16].T)

    b = _compile(f, x, w, jnp.bool_(True))
    assert b.flops[("mla", "forward")] == 2 * (2 * 8 * 16 * 32)


def test_tpu_convolution_with_an_output_dimension_as_a_padded_window():
    """A projection ``btd,dhk->bthk`` as XLA:TPU writes it (the head axis a window of 4 padded by 3 on
    both sides: one real tap per output) and its weight gradient (the batch contracted through a window
    of 2, the heads again a padded window): counted as the dots they are, not 4x."""
    B, T, D, H, K = 2, 256, 256, 4, 64
    hlo = f"""HloModule m

ENTRY %main (x: f32[{B},{T},{D},1], w: bf16[{D},{H},{K},1], dy: bf16[{B},{T},{H},{K}]) -> f32[{D},{H},{K},1] {{
  %x = f32[{B},{T},{D},1]{{3,2,1,0}} parameter(0)
  %w = bf16[{D},{H},{K},1]{{3,2,1,0}} parameter(1)
  %dy = bf16[{B},{T},{H},{K}]{{3,2,1,0}} parameter(2)
  %convolution.1 = f32[{B},{T},{H},{K}]{{3,2,1,0}} convolution(%x, %w), window={{size=1x{H} pad=0_0x{H - 1}_{H - 1} rhs_reversal=0x1}}, dim_labels=0bf1_i1o0->0b1f, metadata={{op_name="jit(f)/kda/btd,dhk->bthk/dot_general"}}
  %y = bf16[{D},{T},{B},1]{{3,2,1,0}} parameter(3)
  ROOT %convolution.2 = f32[{D},{H},{K},1]{{3,2,1,0}} convolution(%y, %dy), window={{size={H}x{B} pad={H - 1}_{H - 1}x0_0 rhs_reversal=1x0}}, dim_labels=bf10_1i0o->b0f1, metadata={{op_name="jit(f)/transpose(jvp(kda))/btd,dhk->bthk/dot_general"}}
}}
"""
    b = bd.breakdown(hlo)
    assert b.flops[("kda", "forward")] == 2 * B * T * D * H * K
    assert b.flops[("kda", "backward")] == 2 * B * T * D * H * K


# A Pallas kernel's text as MaxText's step holds it: splash attention with its backend_config a JSON
# object whose kernel metadata is a pretty-printed JSON string (line breaks, a line that starts with
# "}"), and a megablox grouped matmul with its backend_config a quoted string holding one, inside a
# while loop of 4 trips (TPU form: the count read off the condition), a plain dot after each.
_KERNEL_TRIPS = 4
_MULTILINE_KERNELS_HLO = """HloModule jit_train_step, entry_computation_layout={(bf16[256,128]{1,0}, bf16[128,128]{1,0})->bf16[256,128]{1,0}}

%region_body.10 (arg_tuple.11: (s32[], bf16[256,128], bf16[128,128])) -> (s32[], bf16[256,128], bf16[128,128]) {
  %arg_tuple.11 = (s32[], bf16[256,128]{1,0}, bf16[128,128]{1,0}) parameter(0)
  %get-tuple-element.12 = s32[] get-tuple-element(%arg_tuple.11), index=0
  %get-tuple-element.13 = bf16[256,128]{1,0} get-tuple-element(%arg_tuple.11), index=1
  %get-tuple-element.14 = bf16[128,128]{1,0} get-tuple-element(%arg_tuple.11), index=2
  %custom-call.15 = bf16[256,128]{1,0} custom-call(%get-tuple-element.13, %get-tuple-element.14, %get-tuple-element.14), custom_call_target="tpu_custom_call", operand_layout_constraints={bf16[256,128]{1,0}, bf16[128,128]{1,0}, bf16[128,128]{1,0}}, backend_config={"custom_call_config": {"body": "TUxJUhMBKQ==", "cost_estimate": {"flops": 1000000, "transcendentals": 65536, "bytes_accessed": 196608}, "serialization_format": 1, "needs_layout_passes": true}, "kernel_name": "splash_mha_fwd_no_residuals", "kernel_metadata": "{
  \\"block_sizes\\": {
    \\"block_q\\": 512,
    \\"block_kv\\": 512
  },
  \\"is_mqa\\": false
}"}, metadata={op_name="jit(train_step)/mla/splash_mha_fwd_no_residuals/pallas_call" source_file="maxtext/layers/attentions.py" source_line=412}
  %dot.16 = bf16[256,128]{1,0} dot(%custom-call.15, %get-tuple-element.14), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(train_step)/kda/dot_general"}
  %custom-call.17 = bf16[256,128]{1,0} custom-call(%dot.16, %get-tuple-element.14), custom_call_target="tpu_custom_call", backend_config="{\\"custom_call_config\\": {\\"body\\": \\"TUxJUhMBKQ==\\", \\"cost_estimate\\": {\\"flops\\": 3000000, \\"transcendentals\\": 0, \\"bytes_accessed\\": 131072}}, \\"kernel_name\\": \\"gmm\\", \\"kernel_metadata\\": \\"{
  tiling: [512, 512, 512]
}\\"}", metadata={op_name="jit(train_step)/routed_experts/gmm/pallas_call"}
  %dot.18 = bf16[256,128]{1,0} dot(%custom-call.17, %get-tuple-element.14), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(train_step)/shared_experts/dot_general"}
  %constant.19 = s32[] constant(1)
  %add.20 = s32[] add(%get-tuple-element.12, %constant.19)
  ROOT %tuple.21 = (s32[], bf16[256,128]{1,0}, bf16[128,128]{1,0}) tuple(%add.20, %dot.18, %get-tuple-element.14)
}

%region_cond.30 (arg_tuple.31: (s32[], bf16[256,128], bf16[128,128])) -> pred[] {
  %arg_tuple.31 = (s32[], bf16[256,128]{1,0}, bf16[128,128]{1,0}) parameter(0)
  %get-tuple-element.32 = s32[] get-tuple-element(%arg_tuple.31), index=0
  %constant.33 = s32[] constant(__TRIPS__)
  ROOT %compare.34 = pred[] compare(%get-tuple-element.32, %constant.33), direction=LT
}

ENTRY %main.40 (Arg_0.41: bf16[256,128], Arg_1.42: bf16[128,128]) -> bf16[256,128] {
  %Arg_0.41 = bf16[256,128]{1,0} parameter(0)
  %Arg_1.42 = bf16[128,128]{1,0} parameter(1)
  %constant.43 = s32[] constant(0)
  %tuple.44 = (s32[], bf16[256,128]{1,0}, bf16[128,128]{1,0}) tuple(%constant.43, %Arg_0.41, %Arg_1.42)
  %while.45 = (s32[], bf16[256,128]{1,0}, bf16[128,128]{1,0}) while(%tuple.44), condition=%region_cond.30, body=%region_body.10
  %get-tuple-element.46 = bf16[256,128]{1,0} get-tuple-element(%while.45), index=1
  ROOT %dot.47 = bf16[256,128]{1,0} dot(%get-tuple-element.46, %Arg_1.42), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(train_step)/lm_head_loss/dot_general"}
}
""".replace("__TRIPS__", str(_KERNEL_TRIPS))


def test_kernel_text_with_line_breaks_and_closing_braces():
    """An instruction whose backend_config holds line breaks and a line starting with ``}`` (inside a
    string) is one instruction: its kernel's cost is read, the instructions after it and the later
    computations are all counted (reading it line by line ended the loop body at that ``}``)."""
    comps, entry = hlo_text.parse_hlo(_MULTILINE_KERNELS_HLO)
    assert entry == "main.40"
    assert [i.opcode for i in comps["region_body.10"]][4:] == ["custom-call", "dot", "custom-call", "dot", "constant",
                                                                 "add", "tuple"]
    assert len(comps["region_cond.30"]) == 4 and len(comps[entry]) == 7
    splash = comps["region_body.10"][4]
    assert splash.op_name == "jit(train_step)/mla/splash_mha_fwd_no_residuals/pallas_call"
    assert splash.operands == ["get-tuple-element.13", "get-tuple-element.14", "get-tuple-element.14"]
    b = bd.breakdown(_MULTILINE_KERNELS_HLO)
    dot = 2 * 256 * 128 * 128
    assert b.flops[("mla", "forward")] == _KERNEL_TRIPS * 1_000_000
    assert b.flops[("routed_experts", "forward")] == _KERNEL_TRIPS * 3_000_000
    assert b.flops[("kda", "forward")] == b.flops[("shared_experts", "forward")] == _KERNEL_TRIPS * dot
    assert b.flops[("lm_head_loss", "forward")] == dot
    assert b.total_flops == _KERNEL_TRIPS * (4_000_000 + 2 * dot) + dot
    assert b.attributed_share == 1.0


def test_statements_join_only_open_strings_and_brackets():
    text = 'a = f(x, "s\n}\n"), m={k=1,\n j=2}\n}\nENTRY %main (p: f32[2]) -> f32[2] {\n  %p = f32[2]{0} parameter(0)\n}'
    assert list(hlo_text.statements(text)) == ['a = f(x, "s\n}\n"), m={k=1,\n j=2}', "}",
                                         "ENTRY %main (p: f32[2]) -> f32[2] {", "  %p = f32[2]{0} parameter(0)", "}"]
    # an escaped quote does not end the string
    assert list(hlo_text.statements('x = "a\\"}\nb"\ny')) == ['x = "a\\"}\nb"', "y"]


# The optimizer's branch as XLA:TPU leaves it: the conditional is named only by its operands (the
# balancing bias among them); inside, a Newton-Schulz block summed over the devices as the all-reduce
# of a zero-padded buffer (no op_name: XLA's rewrite of an all-gather), and an all-reduce of the
# branch's operand itself, of which nothing in the HLO says whose it is. Outside, one all-reduce of a
# tuple (XLA combines collectives): a KDA weight's padded gather, whose offset is a constant XLA named
# after the balancing, and a Newton-Schulz block of the same size.
_UNNAMED_COLLECTIVES_HLO = """HloModule jit_step

%add.1 (a.2: f32[], b.3: f32[]) -> f32[] {
  %a.2 = f32[] parameter(0)
  %b.3 = f32[] parameter(1)
  ROOT %add.4 = f32[] add(%a.2, %b.3)
}

%branch.10 (p.11: (f32[64,32], s32[64])) -> f32[64,32] {
  %p.11 = (f32[64,32]{1,0}, s32[64]{0}) parameter(0)
  %get-tuple-element.12 = f32[64,32]{1,0} get-tuple-element(%p.11), index=0
  %constant.13 = f32[] constant(0)
  %broadcast.14 = f32[64,32]{1,0} broadcast(%constant.13), dimensions={}
  %slice.15 = f32[16,32]{1,0} slice(%get-tuple-element.12), slice={[0:16], [0:32]}
  %multiply.16 = f32[16,32]{1,0} multiply(%slice.15, %slice.15), metadata={op_name="jit(step)/cond/branch_1_fun/optimizer/newton_schulz/mul"}
  %partition-id.17 = u32[] partition-id()
  %constant.18 = u32[] constant(16)
  %multiply.19 = u32[] multiply(%partition-id.17, %constant.18)
  %constant.20 = u32[] constant(0)
  %dynamic-update-slice.21 = f32[64,32]{1,0} dynamic-update-slice(%broadcast.14, %multiply.16, %multiply.19, %constant.20)
  %all-reduce.22 = f32[64,32]{1,0} all-reduce(%dynamic-update-slice.21), replica_groups={{0,1,2,3}}, to_apply=%add.1
  %all-reduce.23 = f32[64,32]{1,0} all-reduce(%get-tuple-element.12), replica_groups={{0,1,2,3}}, to_apply=%add.1
  ROOT %add.24 = f32[64,32]{1,0} add(%all-reduce.22, %all-reduce.23)
}

ENTRY %main.30 (p0.31: f32[64,32], p1.32: s32[64]) -> f32[64,32] {
  %p0.31 = f32[64,32]{1,0} parameter(0)
  %p1.32 = s32[64]{0} parameter(1)
  %add.33 = s32[64]{0} add(%p1.32, %p1.32), metadata={op_name="jit(step)/quantile_balancing/add"}
  %tuple.34 = (f32[64,32]{1,0}, s32[64]{0}) tuple(%p0.31, %add.33)
  %constant.35 = s32[] constant(0)
  %conditional.36 = f32[64,32]{1,0} conditional(%constant.35, %tuple.34), branch_computations={%branch.10}, metadata={op_name="jit(step)/cond"}
  %convert.37 = bf16[32,32]{1,0} convert(%p0.31), metadata={op_name="jit(step)/while/body/closed_call/kda/convert_element_type"}
  %constant.38 = s32[] constant(0), metadata={op_name="jit(step)/quantile_balancing/scatter-add"}
  %constant.39 = bf16[] constant(0)
  %broadcast.40 = bf16[128,32]{1,0} broadcast(%constant.39), dimensions={}
  %dynamic-update-slice.41 = bf16[128,32]{1,0} dynamic-update-slice(%broadcast.40, %convert.37, %constant.38, %constant.38)
  %multiply.42 = f32[64,32]{1,0} multiply(%p0.31, %p0.31), metadata={op_name="jit(step)/cond/branch_1_fun/optimizer/newton_schulz/mul"}
  ROOT %all-reduce.43 = (bf16[128,32]{1,0}, f32[64,32]{1,0}) all-reduce(%dynamic-update-slice.41, %multiply.42), replica_groups={{0,1,2,3}}, to_apply=%add.1
}
"""


def test_collectives_without_op_name_go_by_what_they_carry_or_unattributed():
    """A collective without an op_name is named after the operand it carries (the Newton-Schulz
    block, the KDA weight), never after the constants, broadcasts and index arithmetic of a
    computation named after its caller's operands (the balancing bias) nor after a scalar offset; a
    combined one splits its bytes over its operands' parts; one carrying nothing named is
    unattributed (``other``). Before, all of them were put under quantile_balancing."""
    b = bd.breakdown(_UNNAMED_COLLECTIVES_HLO)
    summed = 2 * 64 * 32 * 4 * 3 / 4  # an all-reduce of f32[64,32] (or bf16[128,32]) over 4 devices
    assert b.collective_bytes == {"all-reduce": pytest.approx(4 * summed)}
    assert b.collective_by_dtype == {("all-reduce", "f32"): pytest.approx(2 * summed),
                                     ("all-reduce", "bf16,f32"): pytest.approx(2 * summed)}
    assert b.collective_by_part == {"newton_schulz": pytest.approx(2 * summed), "kda": pytest.approx(summed),
                                    "other": pytest.approx(summed)}
    entry = "main.30"
    _, names, guessed = bd.multipliers(*hlo_text.parse_hlo(_UNNAMED_COLLECTIVES_HLO))
    assert names[("branch.10", "dynamic-update-slice.21")].endswith("newton_schulz/mul")
    assert names[(entry, "dynamic-update-slice.41")].endswith("kda/convert_element_type")
    assert ("branch.10", "all-reduce.23") in guessed and ("branch.10", "all-reduce.22") not in guessed


# tiny with 6 layers and an MLA every 2nd layer: dense KDA layer 0, two scanned [MLA, KDA] groups and a
# final MLA (unrolled and scanned layers, both mixers, dense FFN and MoE)
TRAIN_BATCH, TRAIN_SEQ = 2, 64
TRAIN_OVERRIDES = ["model.num_layers=6", "model.mla_period=2", f"train.batch_size={TRAIN_BATCH}",
                   f"train.seq_len={TRAIN_SEQ}"]
_TRAIN_STEPS = {}


def train_step_breakdown(remat: str):
    """(config, breakdown of the compiled one-device train step) with ``model.remat=remat``; compiled
    once per mode for the module (the two tests share the ``full`` program).

    The tests using it run under ``fast_xla_test``: ``jax_disable_most_optimizations`` lowers only
    XLA:CPU's LLVM code generation (backend optimisation level 0), not the HLO passes whose output the
    breakdown reads. Measured: every (part, phase) FLOP count and the attributed share of both programs
    are identical with and without it, and the two compiles take about a third of the time."""
    if remat not in _TRAIN_STEPS:
        from k3jax import aot
        from k3jax.config import MeshConfig, load_config
        from k3jax.model import abstract_model
        from k3jax.sharding import DEFAULT_RULES, make_mesh

        cfg = load_config("tiny", TRAIN_OVERRIDES + [f"model.remat={remat}"])
        model = abstract_model(cfg.model)
        assert model.plan.num_groups == 2 and model.plan.prefix == (0,) and model.plan.suffix == (5,)
        mesh = make_mesh(MeshConfig(), jax.devices()[:1])
        compiled = aot.lower_train(cfg, mesh, model, DEFAULT_RULES, TRAIN_BATCH, TRAIN_SEQ).compile()
        _TRAIN_STEPS[remat] = cfg, bd.breakdown(compiled.as_text())
    return _TRAIN_STEPS[remat]


@pytest.mark.slow
@pytest.mark.usefixtures("fast_xla_test")
def test_tiny_train_step_matches_analytic_count():
    """Every matmul of the tiny model's train step (scanned layer groups, remat) is attributed, and the
    plain-matmul parts equal ``6 N_part tokens`` (plus one forward for the remat); Newton-Schulz equals
    its analytic count."""
    cfg, b = train_step_breakdown("full")
    expected = analytic.step_flops(cfg, TRAIN_BATCH * TRAIN_SEQ, TRAIN_SEQ)
    assert b.attributed_share >= 0.95
    for part in ("dense_ffn", "shared_experts", "latent_proj", "lm_head_loss"):
        measured = b.part_flops(part) - b.flops.get((part, "recompute"), 0.0)
        assert measured == pytest.approx(expected[part], rel=0.02), part
    # remat=full: every layer runs its forward once more in the backward pass; the
    # head is not rematerialised
    for part in ("shared_experts", "latent_proj"):  # at most one more forward (XLA may skip some)
        assert 0 < b.flops[(part, "recompute")] <= 1.01 * b.flops[(part, "forward")], part
    assert b.flops.get(("lm_head_loss", "recompute"), 0.0) == 0
    assert b.part_flops("newton_schulz") == pytest.approx(expected["newton_schulz"], rel=0.02)
    # KDA's forward, exactly: its weight matmuls (the conv taps, norm gains and gate constants are not
    # matmuls) and the chunkwise core of k3jax.aot.analytic on its exact diagonal path (the costlier branch
    # of the conditional, the one counted; the dense path is 4 B_c K FLOPs per head and token less)
    m = cfg.model
    n_kda, h, k = sum(m.mixer(i) == "kda" for i in range(m.num_layers)), m.kda.num_heads, m.kda.head_dim
    not_matmuls = n_kda * (m.hidden_size + 3 * m.kda.conv_size * h * k + h + h * k + k)
    exact = dataclasses.replace(m, kda=dataclasses.replace(m.kda, gate="softplus"))
    core = analytic.mixing_flops_per_token(exact, TRAIN_SEQ)["kda"]
    kda_weights = analytic.active_params_by_part(m)["kda"] - not_matmuls
    assert b.flops[("kda", "forward")] == (2 * kda_weights + core) * TRAIN_BATCH * TRAIN_SEQ
    for part in ("kda", "mla", "router", "routed_experts"):
        assert b.part_flops(part) > 0, part


@pytest.mark.slow
@pytest.mark.usefixtures("fast_xla_test")
def test_selective_remat_recomputes_no_ffn_matmul_and_no_mixer_core():
    """``model.remat=selective`` keeps the GLU inputs, the routed experts' pair outputs and the
    mixers' core outputs (``k3jax.ops.saved_names``): the backward pass recomputes no FFN / expert
    matmul, and of KDA and MLA only their projections (the chunked KDA pass and the attention are not
    run again), while ``full`` recomputes every part's forward."""
    (_, full), (_, selective) = train_step_breakdown("full"), train_step_breakdown("selective")
    for part in ("routed_experts", "shared_experts", "dense_ffn"):
        assert full.flops[(part, "recompute")] > 0, part
        assert selective.flops.get((part, "recompute"), 0.0) == 0, part
    # KDA: its projections only. MLA: at 64 tokens the attention is one block whose backward needs its
    # probabilities, so the scores are recomputed either way; past attention.Q_CHUNK tokens the saved
    # output spares the layer's recompute of every query block (they are checkpointed on their own).
    assert 0 < selective.flops[("kda", "recompute")] < full.flops[("kda", "recompute")]
    assert 0 < selective.flops[("mla", "recompute")] <= full.flops[("mla", "recompute")]
    for b in (full, selective):  # the same forward and backward work
        for part in ("routed_experts", "kda", "mla"):
            assert b.flops[(part, "forward")] == pytest.approx(full.flops[(part, "forward")], rel=1e-6), part


def test_hbm_bytes_count_what_a_loop_slices_and_an_update_writes():
    """A loop reading a buffer one block per iteration reads it once, and an in-place update of one row writes
    that row: a decode step walks a 1M-slot cache by blocks and writes one slot (counted whole, the step's
    bytes were thousands of times the cache)."""
    x, cache, new = jnp.ones((64, 1024)), jnp.zeros((4096, 256)), jnp.ones((1, 256))

    def step(x, cache, new, i):
        def body(total, j):
            return total + jnp.sum(2.0 * jax.lax.dynamic_slice_in_dim(x, j * 8, 8, axis=0)), None

        return jax.lax.scan(body, 0.0, jnp.arange(8))[0], jax.lax.dynamic_update_slice_in_dim(cache, new, i, axis=0)

    b = bd.breakdown(jax.jit(step, donate_argnums=1).lower(x, cache, new, 3).compile().as_text())
    assert sum(b.hbm_bytes.values()) < 4 * x.nbytes < cache.nbytes  # whole: 8 x x + 2 x cache
