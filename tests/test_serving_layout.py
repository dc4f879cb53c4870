"""The serving layout (``k3jax.sharding.SERVING_DECODE`` / ``SERVING_PREFILL``, issue 43): its rule tables,
and on 8 fake CPU devices (``tests/children/serving_layout.py``, a subprocess: the device count is set before
JAX starts) the engine's greedy tokens against one device's for four tiny model families, and the collective
bytes of a compiled decode step against the activations' bound."""

import pytest
from jax.sharding import PartitionSpec as P

from cpu_devices import run_child
from k3jax.sharding import LAYOUTS, SERVING_DECODE, SERVING_PREFILL, TRAINING, logical_to_spec


class FakeMesh:
    """What ``logical_to_spec`` reads of a mesh: its axis sizes."""

    def __init__(self, **sizes):
        self.shape = {"data": 1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1, **sizes}


def test_serving_tables_split_weights_where_they_are_used():
    decode = SERVING_DECODE.rules
    v5p_64, v5p_128 = FakeMesh(expert=32), FakeMesh(expert=64)
    head_proj = ("embed", "heads", "head_dim")  # [7168, 96, 128] for K3
    # K3's 96 heads split over 32 devices; over 64 they do not divide, and the model dimension splits instead
    assert logical_to_spec(head_proj, decode, v5p_64, (7168, 96, 128)) == P(None, "expert", None)
    assert logical_to_spec(head_proj, decode, v5p_128, (7168, 96, 128)) == P("expert", None, None)
    assert logical_to_spec(("heads", "head_dim", "embed"), decode, v5p_128, (96, 128, 7168)) == P(None, None, "expert")
    # MLA's q_b [q_lora, heads, 192]: by heads where they divide, else by the latent rank
    assert logical_to_spec(("q_lora", "heads", "head_dim"), decode, v5p_64, (1536, 96, 192)) == P(None, "expert", None)
    assert logical_to_spec(("q_lora", "heads", "head_dim"), decode, v5p_128, (1536, 96, 192)) == P("expert", None, None)
    # a low-rank down-projection splits its output columns; the router and experts by expert
    assert logical_to_spec(("embed", "q_lora"), decode, v5p_64, (7168, 1536)) == P(None, "expert")
    assert logical_to_spec(("embed", "expert"), decode, v5p_64, (7168, 896)) == P(None, "expert")
    assert logical_to_spec(("expert", "expert_in", "expert_mlp"), decode, v5p_64, (896, 3584, 3072)) == \
        P("expert", None, None)
    # two axes: the rule's tuple over both where the dimension divides their product
    assert logical_to_spec(head_proj, decode, FakeMesh(expert=32, tensor=2), (7168, 128, 128)) == \
        P(None, ("expert", "tensor"), None)
    # decode activations whole; the MLA cache's rows split, its slots over what the rows leave
    assert logical_to_spec(("batch", "length", None), decode, v5p_64, (32, 1, 7168)) == P(None, None, None)
    assert logical_to_spec(("cache_batch", "cache_length", None), decode, FakeMesh(data=2, expert=32),
                           (32, 1 << 20, 576)) == P("data", "expert", None)
    assert logical_to_spec(("cache_batch", "cache_length", None), decode, v5p_64, (1, 1 << 20, 576)) == \
        P(None, "expert", None)
    # decode uses the weights as stored; prefill gathers the dense ones (over all but `tensor`), not the experts
    assert SERVING_DECODE.weight_use == SERVING_DECODE.rules
    assert logical_to_spec(head_proj, SERVING_PREFILL.weight_use, v5p_64, (7168, 96, 128)) == P(None, None, None)
    assert logical_to_spec(("expert", "expert_in", "expert_mlp"), SERVING_PREFILL.weight_use, v5p_64,
                           (896, 3584, 3072)) == P("expert", None, None)
    # storage is one: decode and prefill agree on every weight name
    names = ("vocab", "embed", "heads", "mlp", "latent", "expert", "expert_in", "expert_mlp", "q_lora", "kv_lora")
    assert all(dict(SERVING_DECODE.rules)[n] == dict(SERVING_PREFILL.rules)[n] for n in names)
    assert LAYOUTS["training"] == (TRAINING, TRAINING)


def test_engine_rejects_an_unknown_layout():
    from k3jax import create_model, load_config
    from k3jax.serving.engine import Engine

    with pytest.raises(ValueError, match="layout must be one of"):
        Engine(create_model(load_config("tiny").model), layout="tensor")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["k3", "k3_mxfp4", "k2_like", "kimi_linear_like"])
def test_engine_on_8_devices_equals_one_device(name):
    run_child("serving_layout", "engine", name)


@pytest.mark.slow
def test_decode_step_moves_activations_not_weights():
    run_child("serving_layout", "collectives")


@pytest.mark.slow
def test_checkpoints_load_straight_into_the_serving_layout():
    run_child("serving_layout", "loading")


@pytest.mark.slow
def test_an_rl_rollout_in_the_serving_layout_samples_as_in_the_trainers():
    run_child("serving_layout", "rollout")
