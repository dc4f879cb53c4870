"""Config loading: named configs, dotted overrides, ``base:`` inheritance, error messages, layouts."""

import dataclasses
import re

import pytest
import yaml

from k3jax.config import (
    CONFIG_DIR,
    Config,
    ConfigError,
    DataConfig,
    KDAConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    from_dict,
    load_config,
    parse_overrides,
    runtime_fields,
    to_dict,
    without_runtime_fields,
)
from k3jax.layers.attn_res import ResidualStream

NAMED = ("k3", "k2", "kimi_linear_48b", "tiny", "small")


def _error(name, overrides=()):
    with pytest.raises(ConfigError) as info:
        load_config(name, list(overrides))
    return str(info.value)


# ----------------------------------------------------------------------------- named configs


@pytest.mark.parametrize("name", NAMED)
def test_named_config_loads(name):
    cfg = load_config(name)
    assert isinstance(cfg, Config)
    assert cfg.name == name
    raw = yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())
    # every value written in the YAML ends up in the dataclass (spot-check the model section)
    for key, value in raw["model"].items():
        got = getattr(cfg.model, key)
        if isinstance(value, dict):
            for sub, sub_value in value.items():
                sub_got = getattr(got, sub)
                if isinstance(sub_value, dict):
                    sub_got = dataclasses.asdict(sub_got)
                    assert all(sub_got[k] == v for k, v in sub_value.items()), (key, sub)
                else:
                    assert sub_got == sub_value, (key, sub)
        else:
            assert got == value, key


def test_named_configs_are_exactly_the_shipped_files():
    shipped = {p.stem for p in CONFIG_DIR.glob("*.yaml")}
    assert set(NAMED) <= shipped


def test_k3_values_match_spec_table():
    m = load_config("k3").model
    assert (m.num_layers, m.hidden_size, m.vocab_size, m.dense_ffn_dim) == (93, 7168, 163840, 33792)
    assert not m.tie_embeddings and m.norm_eps == 1e-5 and m.activation == "situ_glu"
    assert (m.moe.num_experts, m.moe.top_k, m.moe.num_shared_experts) == (896, 16, 2)
    assert (m.moe.latent_dim, m.moe.expert_dim) == (3584, 3072)
    assert (m.kda.num_heads, m.kda.head_dim, m.kda.conv_size, m.kda.gate_lower_bound) == (96, 128, 4, -5.0)
    assert m.kda.gate == "lower_bound" and m.kda.output_gate == "full"
    c = m.mla
    assert (c.num_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (
        96, 1536, 512, 128, 64, 128)
    assert c.rope == "none" and c.output_gate and c.norm_eps == 1e-6
    assert m.attn_res.enabled and m.attn_res.block_size == 12
    residual = ResidualStream.of(m)
    assert residual.num_slots + 1 == 9  # 9 sources at the final readout: 8 bank rows + partial
    assert [i for i in range(m.num_layers) if residual.closes_block(i)] == list(range(0, 93, 12))
    assert m.max_seq_len == 1_048_576


# ----------------------------------------------------------------------------- layouts


def test_k3_layout():
    m = load_config("k3").model
    kinds = [m.mixer(i) for i in range(m.num_layers)]
    assert kinds.count("kda") == 69 and kinds.count("mla") == 24
    for i, kind in enumerate(kinds):
        assert kind == ("mla" if (i + 1) % 4 == 0 or i == 92 else "kda"), i
    assert [m.ffn(i) for i in range(m.num_layers)] == ["dense"] + ["moe"] * 92


def test_kimi_linear_layout_matches_hf_checkpoint_config():
    pytest.importorskip("transformers")
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    full = [4, 8, 12, 16, 20, 24, 27]  # the released config.json, 1-based
    kda = [i for i in range(1, 28) if i not in full]
    hf = KimiLinearConfig(linear_attn_config={"full_attn_layers": full, "kda_layers": kda})
    m = load_config("kimi_linear_48b").model
    assert m.num_layers == hf.num_hidden_layers == 27
    ours = ["full_attention" if m.mixer(i) == "mla" else "linear_attention" for i in range(m.num_layers)]
    assert ours == hf.layer_types
    assert [m.ffn(i) for i in range(27)] == ["dense" if t == "dense" else "moe" for t in hf.mlp_layer_types]
    # the widths that HF's defaults carry for Kimi Linear 48B
    assert (m.vocab_size, m.hidden_size, m.dense_ffn_dim) == (hf.vocab_size, hf.hidden_size, hf.intermediate_size)
    assert (m.moe.num_experts, m.moe.top_k, m.moe.num_shared_experts, m.moe.expert_dim) == (
        hf.num_local_experts, hf.num_experts_per_tok, hf.n_shared_experts, hf.moe_intermediate_size)
    assert m.moe.routed_scaling_factor == pytest.approx(hf.routed_scaling_factor)
    assert (m.kda.num_heads, m.kda.head_dim, m.kda.conv_size) == (
        hf.linear_num_heads, hf.linear_head_dim, hf.linear_conv_kernel_dim)
    c = m.mla
    assert (c.num_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (
        hf.num_attention_heads, hf.kv_lora_rank, hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim)
    assert hf.q_lora_rank is None and c.q_lora_rank == 0
    assert m.norm_eps == hf.rms_norm_eps


def test_k2_layout():
    m = load_config("k2").model
    assert all(m.mixer(i) == "mla" for i in range(61))
    assert [m.ffn(i) for i in range(61)] == ["dense"] + ["moe"] * 60
    assert not m.attn_res.enabled and m.activation == "swiglu" and m.mla.rope == "yarn"


def test_mla_layers_override_layout():
    m = load_config("tiny", ["model.mla_layers=[0, 5]"]).model
    assert [i for i in range(m.num_layers) if m.mixer(i) == "mla"] == [0, 5]
    m = load_config("tiny", ["model.layout=kda", "model.last_layer_mla=false"]).model
    assert not m.uses("mla") and m.uses("kda")


# ----------------------------------------------------------------------------- overrides / inheritance


def test_dotted_overrides():
    cfg = load_config("tiny", ["model.moe.top_k=4", "train.steps=7", "model.kda.gate=softplus",
                               "model.mla_layers=[1, 2]", "model.init_std=0.5", "name=renamed"])
    assert cfg.model.moe.top_k == 4 and cfg.train.steps == 7 and cfg.model.kda.gate == "softplus"
    assert cfg.model.mla_layers == (1, 2) and cfg.model.init_std == 0.5 and cfg.name == "renamed"
    base = load_config("tiny")
    # untouched fields keep their values, including siblings inside an overridden section
    assert cfg.model.moe.num_experts == base.model.moe.num_experts
    assert cfg.model.kda.head_dim == base.model.kda.head_dim
    assert cfg.train.batch_size == base.train.batch_size
    # int given for a float field is accepted and converted
    assert isinstance(load_config("tiny", ["model.init_std=1"]).model.init_std, float)
    # YAML 1.1 reads exponent floats without a dot as strings; they are numbers all the same
    assert load_config("tiny", ["train.optim.adam_eps=1e-3"]).train.optim.adam_eps == 1e-3
    with pytest.raises(ConfigError, match=r"^train\.optim\.adam_eps: expected a number"):
        load_config("tiny", ["train.optim.adam_eps=small"])


def test_parse_overrides_nests_and_parses_yaml():
    assert parse_overrides(["a.b.c=1", "a.b.d=[1, 2]", "a.e=x", "f=true"]) == {
        "a": {"b": {"c": 1, "d": [1, 2]}, "e": "x"}, "f": True}
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["model.hidden_size"])


def test_base_inheritance(tmp_path):
    (tmp_path / "parent.yaml").write_text(
        "base: tiny\nmodel:\n  hidden_size: 96\n  moe: {top_k: 3}\ntrain: {steps: 5}\n")
    (tmp_path / "child.yaml").write_text(
        f"base: {tmp_path / 'parent.yaml'}\nmodel:\n  moe: {{num_experts: 12}}\n")
    tiny = load_config("tiny")
    parent = load_config(str(tmp_path / "parent.yaml"))
    assert parent.name == "parent"  # the base's name is not inherited
    assert parent.model.hidden_size == 96 and parent.model.moe.top_k == 3 and parent.train.steps == 5
    # everything else comes from tiny, including siblings of overridden keys
    assert parent.model.moe.num_experts == tiny.model.moe.num_experts
    assert parent.model.kda == tiny.model.kda and parent.model.num_layers == tiny.model.num_layers
    child = load_config(str(tmp_path / "child.yaml"), ["model.moe.top_k=5"])
    assert child.name == "child"
    assert (child.model.hidden_size, child.model.moe.num_experts, child.model.moe.top_k) == (96, 12, 5)


def test_base_cycle_is_an_error(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(f"base: {b}\n")
    b.write_text(f"base: {a}\n")
    with pytest.raises(ConfigError, match="circular"):
        load_config(str(a))


# ----------------------------------------------------------------------------- errors name the field


@pytest.mark.parametrize("override, field, suggestion", [
    ("model.hiden_size=64", "model.hiden_size", "model.hidden_size"),
    ("model.moe.topk=2", "model.moe.topk", "model.moe.top_k"),
    ("model.kda.num_head=2", "model.kda.num_head", "model.kda.num_heads"),
    ("trian.steps=3", "trian", "train"),
])
def test_unknown_key_names_field_and_suggests(override, field, suggestion):
    msg = _error("tiny", [override])
    assert msg.startswith(f"{field}:"), msg
    assert "unknown key" in msg and f"did you mean {suggestion}?" in msg, msg


def test_unknown_key_in_yaml_file(tmp_path):
    (tmp_path / "bad.yaml").write_text("base: tiny\nmodel:\n  attn_res: {blok_size: 2}\n")
    msg = _error(str(tmp_path / "bad.yaml"))
    assert msg.startswith("model.attn_res.blok_size:") and "did you mean model.attn_res.block_size?" in msg


@pytest.mark.parametrize("override, field, pattern", [
    ("model.moe.top_k=9", "model.moe.top_k", r"num_experts=8"),  # tiny has 8 experts
    ("model.moe.top_k=0", "model.moe.top_k", r"must be in"),
    ("model.hidden_size=abc", "model.hidden_size", r"integer"),
    ("model.hidden_size=1.5", "model.hidden_size", r"integer"),
    ("model.num_layers=true", "model.num_layers", r"integer"),
    ("model.attn_res.enabled=3", "model.attn_res.enabled", r"true/false"),
    ("model.init_std=big", "model.init_std", r"number"),
    ("model.moe=5", "model.moe", r"mapping"),
    ("model.mla_layers=3", "model.mla_layers", r"list"),
    ("model.mla_layers=[1, x]", "model.mla_layers[1]", r"integer"),
    ("model.kda.gate=sigmoid", "model.kda.gate", r"lower_bound"),
    ("model.activation=gelu", "model.activation", r"situ_glu"),
    ("model.mla.rope=alibi", "model.mla.rope", r"yarn"),
    ("model.dtype=float16", "model.dtype", r"bfloat16"),
    ("model.mla_layers=[0, 13]", "model.mla_layers", r"\[13\].*out of range"),
    ("model.mla_layers=[-1]", "model.mla_layers", r"out of range"),
    ("model.kda.gate_lower_bound=1.0", "model.kda.gate_lower_bound", r"negative"),
    ("model.attn_res.block_size=0", "model.attn_res.block_size", r"positive"),
    ("train.seq_len=4096", "train.seq_len", r"max_seq_len"),
])
def test_bad_values_name_the_field(override, field, pattern):
    msg = _error("tiny", [override])
    assert msg.startswith(f"{field}:"), msg
    assert re.search(pattern, msg), msg


def test_choices_come_from_the_literal_annotations():
    """Configs built in Python (no YAML, no overrides) are checked against the same ``Literal``
    annotations, with the field's path and the allowed values in the message."""
    with pytest.raises(ConfigError, match=r"^model\.kda\.gate: must be one of \['lower_bound', 'softplus'\], "
                                          r"got 'sigmoid'$"):
        ModelConfig(kda=KDAConfig(gate="sigmoid")).validate()
    with pytest.raises(ConfigError, match=r"^train\.optim\.schedule: must be one of \['cosine', 'wsd', 'constant'\]"):
        TrainConfig(optim=OptimConfig(schedule="linear")).validate()
    with pytest.raises(ConfigError, match=r"^model\.remat: must be one of"):
        ModelConfig(remat="some").validate()


def test_runtime_fields_are_marked_on_the_fields():
    """One mark says which fields may differ between a checkpoint and the config that reads or resumes
    it (checkpoint.py) and which an HF round trip ignores (interop/hf_config.py)."""
    assert runtime_fields(ModelConfig) == {"remat", "kda_impl", "moe_impl", "max_seq_len", "init_std"}
    assert runtime_fields(TrainConfig) == {"steps", "log_every", "eval_every", "checkpoint_every",
                                           "keep_checkpoints", "out_dir", "max_nonfinite_steps", "on_nonfinite",
                                           "wandb", "profile"}
    assert runtime_fields(DataConfig) == {"bad_records"}  # a run stopped by a bad record resumes skipping it
    base = load_config("tiny")
    same = load_config("tiny", ["model.remat=full", "model.kda.chunk_size=16", "model.moe.ep_dispatch=all_to_all",
                                "train.steps=7", "mesh.data=2"])
    assert without_runtime_fields(base) == without_runtime_fields(same)
    assert without_runtime_fields(base) != without_runtime_fields(load_config("tiny", ["model.kda.conv_size=2"]))
    from k3jax.training import checkpoint
    from k3jax.interop.hf_config import runtime_fields_equal

    assert checkpoint.RESUMABLE_TRAIN_FIELDS == runtime_fields(TrainConfig)
    assert checkpoint.config_mismatch(same, base) == ""  # a run may resume with other runtime fields
    assert "model.kda.conv_size" in checkpoint.config_mismatch(load_config("tiny", ["model.kda.conv_size=2"]), base)
    assert runtime_fields_equal(same.model, base.model)


def test_unknown_config_name_lists_the_named_ones():
    msg = _error("k4")
    assert "'k4'" in msg
    for name in NAMED:
        assert name in msg


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    msg = _error(str(missing))
    assert str(missing) in msg and "does not exist" in msg


def test_unknown_base_is_an_error(tmp_path):
    (tmp_path / "x.yaml").write_text("base: no_such_config\n")
    assert "no_such_config" in _error(str(tmp_path / "x.yaml"))


# ----------------------------------------------------------------------------- serialisation


@pytest.mark.parametrize("name", NAMED)
def test_to_dict_from_dict_round_trip(name, tmp_path):
    cfg = load_config(name, ["model.mla_layers=[0, 3]"] if name == "tiny" else [])
    d = to_dict(cfg)
    assert from_dict(d) == cfg
    # plain data: survives a YAML dump and a reload through load_config
    path = tmp_path / f"{name}_dump.yaml"
    path.write_text(yaml.safe_dump(d))
    assert load_config(str(path)) == cfg
    # and a changed value does not compare equal
    d["model"]["hidden_size"] += 2
    assert from_dict(d) != cfg


def test_from_dict_validates():
    d = to_dict(load_config("tiny"))
    d["model"]["moe"]["top_k"] = 100
    with pytest.raises(ConfigError, match=r"^model\.moe\.top_k:"):
        from_dict(d)


@pytest.mark.parametrize("max_seq_len", [64, 4096])
def test_the_run_config_of_a_loaded_model_fits_its_context(max_seq_len):
    """A HF checkpoint whose max_position_embeddings is under the default row length loads, converts and
    serves: its run config's rows are cut to the model's context (a plain Config(model=...) fails validation
    and so its saved checkpoint could not be restored)."""
    model = dataclasses.replace(load_config("tiny").model, max_seq_len=max_seq_len)
    cfg = Config.of_model(model, "loaded")
    cfg.validate()
    assert cfg.name == "loaded" and cfg.model == model
    assert cfg.train.seq_len == min(max_seq_len, Config().train.seq_len)
    if max_seq_len < Config().train.seq_len:
        with pytest.raises(ConfigError, match=r"^train\.seq_len:"):
            Config(model=model).validate()
