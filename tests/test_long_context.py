"""Long training rows (issue 31): a tiny K3 on one row of 32,768 tokens split over 8 sequence shards (fake
CPU devices) gives the single-device logits and gradients, with packed documents whose boundaries fall
inside shards and exactly on one; no shard holds the row's MLA keys or values (the jaxpr of every
``shard_map`` body), and the only collectives that move whole-row arrays are MLA's latent gather and its
transpose (the optimized HLO: Block AttnRes, the MoE and the KDA / conv are per token or exchange states and
halos only). Full K3's MLA layer traced on a 1M-token row over v5p-1024's 512 time shards holds nothing
per shard beyond the gathered latent. Bad long-context settings stop before compiling with an error naming
the setting; ``python -m k3jax.aot --mode prefill`` compiles a prompt chunk into a long cache; K2's YaRN
fields come from a checkpoint's legacy ``rope_scaling`` and match transformers past the original context.

The 8-device check runs in a subprocess (``tests/children/long_row.py``): the device count must be set
before JAX starts.
"""

import pytest

from cpu_devices import run_child
from jaxprs import shard_map_avals
from k3jax.config import load_config

# d = 32, two layers (KDA with a dense FFN, MLA with the MoE; AttnRes blocks of 1), 3 MLA heads with 24-wide
# keys and values over a 16 + 8 latent: the row's expanded keys (3 x 24 per token) are 3x the latent. The
# router selects every expert (top_k = num_experts), so no token's expert choice can flip on a rounding
# difference between the layouts (at 32k random tokens a few would, and their logits would differ by
# whole expert outputs).
TINY_LONG = ["model.hidden_size=32", "model.num_layers=2", "model.mla_period=2", "model.dense_ffn_dim=64",
             "model.max_seq_len=32768",
             "model.kda={num_heads: 2, head_dim: 8, conv_size: 4, gate: lower_bound, output_gate: full, "
             "chunk_size: 64}",
             "model.mla={num_heads: 3, q_lora_rank: 16, kv_lora_rank: 16, qk_nope_head_dim: 16, "
             "qk_rope_head_dim: 8, v_head_dim: 24, rope: none, output_gate: true}",
             "model.moe={num_experts: 2, top_k: 2, num_shared_experts: 1, expert_dim: 16, latent_dim: 16, "
             "latent_norm: true, routed_scaling_factor: 1.0}",
             "model.attn_res={enabled: true, block_size: 1}"]

@pytest.mark.slow
def test_long_row_sequence_parallel_matches_single_device():
    # with XLA's optimisation passes (unlike the other device scripts): the 32k-token row's run time is
    # most of this test, and unfused it is several times longer
    print(run_child("long_row", *TINY_LONG, timeout=1200, JAX_DISABLE_MOST_OPTIMIZATIONS="0"))


# ---------------------------------------------------------------------------------------------
# K2's context extension: YaRN from the checkpoint's legacy ``rope_scaling`` (the Kimi K2 release layout)


@pytest.mark.slow
@pytest.mark.usefixtures("fast_xla")
def test_yarn_rope_scaling_from_a_legacy_hf_config_matches_transformers(tmp_path):
    """A tiny DeepSeek-V3 whose config.json carries YaRN as ``rope_scaling`` (K2's layout: type, factor,
    original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim, all set to values that
    change the result): every field reaches ``model.mla.yarn`` and the logits equal transformers' on
    positions up to 4x past the original context."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import json

    import jax.numpy as jnp
    import numpy as np
    from test_hf_interop import REL_TOL, deepseek_config, hf_logits, randomize_torch, rel_err
    from transformers import DeepseekV3ForCausalLM

    from k3jax.interop import from_hf

    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8.0,
               "beta_slow": 2.0, "mscale": 0.8, "mscale_all_dim": 0.6}
    hf_cfg = deepseek_config()
    hf_cfg.rope_parameters = {"rope_type": "yarn", "rope_theta": 50000.0,
                              **{k: v for k, v in scaling.items() if k != "type"}}
    hf_cfg.max_position_embeddings = 128
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(hf_cfg).eval()
    randomize_torch(model, 3)
    model.save_pretrained(tmp_path)
    tokens = np.random.default_rng(1).integers(0, 96, (1, 64)).astype(np.int32)
    ref = hf_logits(model, tokens)
    config = json.loads((tmp_path / "config.json").read_text())  # rewritten as the K2 release writes it
    config.pop("rope_parameters")
    config.update(rope_scaling=scaling, rope_theta=50000.0)
    (tmp_path / "config.json").write_text(json.dumps(config))

    loaded = from_hf(tmp_path)
    yarn = loaded.cfg.mla.yarn
    assert loaded.cfg.mla.rope == "yarn" and loaded.cfg.max_seq_len == 128
    assert (yarn.factor, yarn.original_max_position, yarn.beta_fast, yarn.beta_slow, yarn.mscale,
            yarn.mscale_all_dim) == (4.0, 16, 8.0, 2.0, 0.8, 0.6)
    out = np.asarray(loaded(jnp.asarray(tokens))[0])
    _, rel = rel_err(out, ref)
    assert rel < REL_TOL, rel


# ---------------------------------------------------------------------------------------------
# Bad long-context settings: one line naming the setting, before anything compiles


def test_train_rows_must_split_over_the_sequence_shards():
    from k3jax.config import ConfigError

    with pytest.raises(ConfigError, match=r"train.seq_len: 100 tokens per row do not split over mesh.sequence=8"):
        load_config("tiny", ["mesh.data=1", "mesh.sequence=8", "train.seq_len=100"])
    with pytest.raises(ConfigError, match=r"train.seq_len: 2 tokens per sequence shard .* 3-token halo"):
        load_config("tiny", ["mesh.data=1", "mesh.sequence=8", "train.seq_len=16"])
    assert load_config("tiny", ["mesh.data=1", "mesh.sequence=8", "train.seq_len=64"]).train.seq_len == 64
    with pytest.raises(ConfigError, match=r"train.seq_len: 4096 exceeds model.max_seq_len=2048"):
        load_config("tiny", ["train.seq_len=4096"])


def test_aot_refuses_rows_the_sequence_axis_does_not_split(capsys):
    from k3jax import aot

    with pytest.raises(SystemExit):
        aot.main(["--config", "tiny", "--mode", "train", "--slice", "v5p-16", "--mesh", "sequence=8",
                  "--seq-len", "1001"])
    assert "--seq-len 1001: the rows do not split over the mesh's sequence=8 shards" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        aot.main(["--config", "tiny", "--mode", "prefill", "--slice", "v5p-16", "--seq-len", "1024",
                  "--prefill-chunk", "2048"])
    assert "--prefill-chunk 2048 must be in [1, --seq-len 1024]" in capsys.readouterr().err


@pytest.mark.usefixtures("fast_xla")
def test_a_context_longer_than_the_cache_or_the_model_is_refused():
    import jax.numpy as jnp
    import numpy as np

    from k3jax import create_model, generate
    from k3jax.serving.engine import Engine

    cfg = load_config("tiny", ["model.max_seq_len=64", "train.seq_len=64", "model.num_layers=2"]).model
    model = create_model(cfg)
    tokens = jnp.ones((1, 10), jnp.int32)
    with pytest.raises(ValueError, match="10 new tokens do not fit a cache of 8 slots"):
        model(tokens, cache=model.init_cache(1, 8))
    _, cache = model(tokens[:, :6], cache=model.init_cache(1, 12))
    with pytest.raises(ValueError, match="6 cached \\+ 10 new tokens exceed the cache's 12 slots"):
        model(tokens, cache=cache)
    with pytest.raises(ValueError, match=r"prompt \(60\) \+ max_new_tokens \(5\) = 65 exceeds the model's "
                                         r"max_seq_len=64"):
        generate(model, np.ones((1, 60), np.int32), 5)
    engine = Engine(model, max_batch=1, max_len=32, prefill_chunk=8)
    with pytest.raises(ValueError, match=r"prompt \(30 tokens\) \+ max_tokens \(4\) exceeds the context of 32"):
        engine.check(30, 4)
    with pytest.raises(ValueError, match=r"max_len must be in \[2, model.max_seq_len=64\]"):
        Engine(model, max_len=128)


@pytest.mark.tpu_aot
def test_aot_prefill_mode_compiles_a_chunk_into_a_long_cache():
    """``python -m k3jax.aot --mode prefill``: a prompt chunk written into a cache of the whole context,
    compiled for a v5p slice (libtpu, no TPU), cache donated; the table names the chunk and the context, and
    ``--breakdown`` counts its attention."""
    pytest.importorskip("libtpu")
    from k3jax import aot
    from k3jax.config import MeshConfig

    try:
        devices = aot.TpuSlice.v5p("v5p-8").devices()
    except Exception as e:  # libtpu present but unusable on this host
        pytest.skip(f"no TPU topology from libtpu: {e}")
    job = aot.Job("small", "prefill", "v5p-8", MeshConfig(data=1, fsdp=2, expert=2), batch=1, seq_len=4096,
                  overrides=("model.layout=mla", "model.num_layers=2"), prefill_chunk=256)
    r = aot.compile_job(job, devices=devices, breakdown=True)
    assert not r.error and r.fits, r.error
    assert r.alias_bytes > 0  # the cache is updated in place
    assert r.tokens == 256
    # The breakdown counts the chunk's absorbed attention over the whole cache as the analytic model does.
    mla = r.breakdown.part_flops("mla") * r.num_devices
    assert mla == pytest.approx(r.analytic["mla"], rel=0.05), (mla, r.analytic["mla"])
    assert "its analytic count" not in aot.breakdown_report(r)[0]  # no Newton-Schulz outside training
    assert "prefill 1 x 256 @ 4,096 ctx" in aot.table([r])


@pytest.mark.tpu_aot
def test_k3_mla_shards_of_a_1m_row_hold_no_keys_or_values():
    """Full K3's MLA layer, forward and backward, on one 1,048,576-token row over v5p-1024's 512 time shards
    (``expert=64, sequence=8``; traced only, nothing allocated or compiled): the largest per-shard arrays
    are the gathered latent (1.125 GiB in bf16) and its blocked views; nothing else reaches a quarter of it,
    and no array carries the heads dim over the whole row (the row's keys and values would be 60 GiB)."""
    pytest.importorskip("libtpu")
    import math

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from k3jax import aot
    from k3jax.config import MeshConfig
    from k3jax.layers.mla import MLA
    from k3jax.sharding import make_mesh

    try:
        devices = aot.TpuSlice.v5p("v5p-1024").devices()
    except Exception as e:  # libtpu present but unusable on this host
        pytest.skip(f"no TPU topology from libtpu: {e}")
    cfg = load_config("k3").model
    t, mla = 1 << 20, cfg.mla
    mesh = make_mesh(MeshConfig(data=1, expert=64, sequence=8), devices)
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(nnx.eval_shape(lambda: MLA(cfg, rngs=nnx.Rngs(0))))

    def loss(params, x, seg, pos):
        y, _ = nnx.merge(graphdef, params)(x, positions=pos, segment_ids=seg)
        return jnp.sum(y.astype(jnp.float32))

    row = jax.ShapeDtypeStruct((1, t), jnp.int32)
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(jax.grad(loss))(params, jax.ShapeDtypeStruct((1, t, cfg.hidden_size), jnp.bfloat16),
                                               row, row).jaxpr

    avals = shard_map_avals(jaxpr)
    latent_bytes = t * (mla.kv_lora_rank + mla.qk_rope_head_dim) * 2
    nbytes = lambda a: math.prod(a.shape) * a.dtype.itemsize  # noqa: E731
    assert max(map(nbytes, avals)) == latent_bytes
    assert all(nbytes(a) == latent_bytes or nbytes(a) < latent_bytes / 4 for a in avals)
    assert not [a.shape for a in avals if t in a.shape and mla.num_heads in a.shape]
