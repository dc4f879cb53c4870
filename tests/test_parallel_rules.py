"""One sharding language: the ``shard_map`` regions of ``k3jax.parallel`` take their PartitionSpecs and
collective axes from the rule table of ``k3jax.sharding``, so swapping the table (``axis_rules``) moves
them with the parameters and activations.

The specs are read from the traced programs (an abstract 16-device mesh, nothing runs); the values under
a swapped table are checked on 8 fake CPU devices in a subprocess (``tests/children/swapped_rules.py``; the
device count must be set before JAX starts, and the rest of the suite runs on one device).
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

from k3jax.parallel import sequence
from k3jax.parallel.expert import expert_parallel_experts
from k3jax.sharding import (DEFAULT_RULES, MESH_AXES, axis_rules, constrain_activation, current_rules,
                            expert_mesh_axes, logical_to_spec, token_mesh_axes)

from cpu_devices import run_child

# data=1, fsdp=2, expert=2, sequence=2, tensor=2
MESH = AbstractMesh((1, 2, 2, 2, 2), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))

# Every rule the parallel regions read moved to other mesh axes.
SWAPPED = tuple(dict(DEFAULT_RULES, batch=("expert",), length=("sequence",), heads=("fsdp",),
                     expert=("tensor",)).items())

B, T, H, K, W = 4, 32, 4, 8, 4  # batch, time, heads, head dim, conv window
N, L, F, E, TOP_K = 64, 16, 24, 8, 3  # tokens, latent width, expert width, experts, experts per token


def shard_map_specs(fn, *args):
    """(in_specs, out_specs) of every ``shard_map`` in the program of ``fn(*args)``, traced under MESH.
    ``fn`` must be a new function each time: tracing caches by function, and the rule table is read when
    tracing (as it is under ``jax.jit``)."""
    with jax.sharding.use_abstract_mesh(MESH):
        jaxpr = jax.make_jaxpr(fn)(*args)
    return [(eqn.params["in_specs"], eqn.params["out_specs"]) for eqn in jaxpr.jaxpr.eqns
            if eqn.primitive.name == "shard_map"]


def sds(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def region_specs():
    """The specs of the expert-parallel experts and the sequence-parallel conv, KDA and MLA regions."""
    expert_args = (sds(N, L), sds(N, TOP_K, dtype=jnp.int32), sds(N, TOP_K), sds(E, L, F), sds(E, L, F),
                   sds(E, F, L))
    qk = sds(B, T, H, K)
    attend = lambda q, lat, qi, ki, qs, ks, kv_b: q  # the layer's attention is not what is checked here
    return {
        "expert": shard_map_specs(lambda *a: expert_parallel_experts(*a, activation="situ_glu",
                                                                     dispatch="all_gather"), *expert_args),
        "conv": shard_map_specs(lambda x, w: sequence.causal_conv1d(x, w), sds(B, T, H * K), sds(W, H * K)),
        "kda": shard_map_specs(lambda *a: sequence.chunk_kda(*a, chunk_size=8), qk, qk, qk, qk, sds(B, T, H)),
        "mla": shard_map_specs(lambda q, lat, kv_b: sequence.mla_attention(attend, q, lat, None, kv_b),
                               qk, sds(B, T, 12), sds(8, H, K)),
    }


def expected_specs(tokens, experts, batch, time, heads, expert_in):
    """The regions' specs for the given entries of each dimension (the expert weights enter split over
    their ``expert_in`` storage axes, gathered inside)."""
    act = P(batch, time, heads, None)
    weights = (P(experts, expert_in, None),) * 2 + (P(experts, None, expert_in),)  # w_gate, w_up, w_down
    return {
        "expert": [((P(tokens, None),) * 3 + weights, (P(tokens, None),))],
        "conv": [((P(batch, time, heads), P(None, heads)), (P(batch, time, heads),))],
        "kda": [((act,) * 4 + (P(batch, time, heads),), (act,))],
        "mla": [((act, P(batch, time, None), P(None, heads, None)), (act,))],
    }


def test_default_table_specs():
    """The default table: batch over the data-like axes, time over ``sequence``, heads over ``tensor``,
    experts over ``expert``, the experts' tokens over every axis (the layouts before the derivation)."""
    assert current_rules() == DEFAULT_RULES
    assert expert_mesh_axes(MESH) == ("expert",) and token_mesh_axes(MESH, N) == MESH_AXES[1:]
    assert region_specs() == expected_specs(("fsdp", "expert", "sequence", "tensor"), "expert",
                                            ("fsdp", "expert"), "sequence", "tensor", ("fsdp", "sequence"))


def test_shard_map_specs_follow_a_swapped_table():
    with axis_rules(SWAPPED):
        assert current_rules() == SWAPPED
        assert expert_mesh_axes(MESH) == ("tensor",)
        # the batch rule's axes first, then the length rule's, then the mesh's others (in mesh order)
        assert token_mesh_axes(MESH, N) == ("expert", "sequence", "fsdp", "tensor")
        assert token_mesh_axes(MESH, 4) == ("expert", "sequence")
        got = region_specs()
        # GSPMD's layouts follow the same table
        x = sds(B, T, H, K)
        with jax.sharding.use_abstract_mesh(MESH):
            jaxpr = jax.make_jaxpr(lambda x: constrain_activation(x, ("batch", "length", "heads", None)))(x)
        constraint = [e.params["sharding"].spec for e in jaxpr.jaxpr.eqns if e.primitive.name == "sharding_constraint"]
        assert constraint == [logical_to_spec(("batch", "length", "heads", None), SWAPPED, MESH, x.shape)]
    assert got == expected_specs(("expert", "sequence", "fsdp", "tensor"), "tensor", "expert", "sequence", "fsdp",
                                 ("fsdp", "sequence"))
    assert current_rules() == DEFAULT_RULES  # restored on exit


def test_expert_rule_must_split_the_experts():
    odd = tuple(dict(DEFAULT_RULES, expert=(("fsdp", "expert", "sequence"),)).items())  # 8 devices, 6 experts
    args = (sds(N, L), sds(N, TOP_K, dtype=jnp.int32), sds(N, TOP_K), sds(6, L, F), sds(6, L, F), sds(6, F, L))
    with axis_rules(odd), pytest.raises(ValueError, match=r"6 experts do not split over the expert rule's mesh "
                                                         r"axes \('fsdp', 'expert', 'sequence'\) \(size 8\)"):
        shard_map_specs(lambda *a: expert_parallel_experts(*a, activation="situ_glu"), *args)


@pytest.mark.slow
def test_swapped_table_values_match_single_device():
    print(run_child("swapped_rules"))
