"""``model.remat`` policies that keep named values (k3jax/ops/saved_names.py): what a policy keeps is not
computed again in the backward pass (their gradients equal ``remat = none``'s:
``tests/test_model.py::test_remat_gives_identical_grads``).

The backward pass of a rematerialised layer is the ``remat`` equation JAX leaves after differentiating
(``differentiated=True``): its jaxpr holds the recomputed forward work beside the transposed one. A value
the policy keeps (saved on the device or offloaded to the host) is read from the forward pass, so its
``name`` equation and the work behind it (a projection's matmul, the attention's score and value products)
are not in that jaxpr.
"""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import load_config
from k3jax.model import create_model
from k3jax.ops import saved_names
from tests.jaxprs import equations

pytestmark = pytest.mark.usefixtures("fast_xla")

# prefix layer 0 (KDA, dense FFN), two scanned groups [KDA, MLA], suffix layer 5 (MLA): both mixers inside
# and outside the layer scan
CFG = load_config("tiny", ["model.num_layers=6", "model.mla_period=2"]).model
TOK = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 37)), jnp.int32)  # 37: not a chunk multiple
COT = jnp.asarray(np.random.default_rng(1).standard_normal(TOK.shape + (CFG.vocab_size,)), jnp.float32)


def _loss_and_params(remat: str):
    model = create_model(dataclasses.replace(CFG, remat=remat), seed=0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        return jnp.sum(nnx.merge(graphdef, p, rest)(TOK)[0] * COT)

    return model, loss, params


def _grad_jaxpr(remat: str):
    model, loss, params = _loss_and_params(remat)
    return model, jax.make_jaxpr(jax.grad(loss))(params).jaxpr


def _backward_equations(jaxpr):
    """Every equation inside the differentiated remat equations (the backward passes of the layers)."""
    for eqn, _ in equations(jaxpr):
        if eqn.primitive.name.startswith("remat") and eqn.params.get("differentiated"):
            yield from (e for e, _ in equations(eqn.params["jaxpr"]))


def _names(eqns) -> collections.Counter:
    return collections.Counter(e.params["name"] for e in eqns if e.primitive.name == "name")


def _dots(eqns) -> int:
    return sum(e.primitive.name == "dot_general" for e in eqns)


@pytest.fixture(scope="module")
def traced():
    """{remat: (model, the gradient's jaxpr)} for the policies compared here."""
    return {remat: _grad_jaxpr(remat) for remat in ("outputs", "outputs_offload")}


def test_outputs_recomputes_the_attention_and_the_projections(traced):
    """The control: under ``outputs`` the backward computes the attention's residuals and the mixers'
    projections again (what ``outputs_offload`` is for), but none of the sublayer outputs it keeps."""
    names = _names(_backward_equations(traced["outputs"][1]))
    assert names[saved_names.ATTENTION_RESIDUALS] > 0 and names[saved_names.MIXER_PROJECTIONS] > 0, names
    assert not any(names[n] for n in saved_names.SUBLAYER_OUTPUTS), names


def test_outputs_offload_recomputes_nothing_it_keeps(traced):
    model, jaxpr = traced["outputs_offload"]
    backward = list(_backward_equations(jaxpr))
    names = _names(backward)
    kept = (*saved_names.OUTPUTS_AND_ATTENTION, *saved_names.HOST_SAVED)
    assert not any(names[n] for n in kept), names
    # the work behind them is gone too: per traced layer (prefix, one group's body, suffix), the KDA layer's
    # q, k, v and gate projections, the MLA layer's gate projection and its attention forward (the key
    # block's expansion, the scores, the values)
    kinds = [layer.kind[0] for layer in (*model.prefix, *model.groups.layers, *model.suffix)]
    spared = 4 * kinds.count("kda") + (1 + 3) * kinds.count("mla")
    outputs_dots = _dots(_backward_equations(traced["outputs"][1]))
    assert outputs_dots - _dots(backward) == spared, (outputs_dots, _dots(backward), spared)


def test_outputs_offload_moves_the_projections_to_host(traced):
    """Each projection named MIXER_PROJECTIONS goes to host memory in the forward pass and comes back
    in the backward (one ``device_put`` each way per traced projection)."""
    model, jaxpr = traced["outputs_offload"]
    kinds = [layer.kind[0] for layer in (*model.prefix, *model.groups.layers, *model.suffix)]
    projections = 4 * kinds.count("kda") + kinds.count("mla")
    to_host = [e for e, _ in equations(jaxpr) if e.primitive.name == "device_put"
               and any("Host" in str(d) for d in e.params["devices"])]
    back = [e for e in _backward_equations(jaxpr) if e.primitive.name == "device_put"
            and any("Device" in str(d) for d in e.params["devices"])]
    assert len(to_host) == len(back) == projections, (len(to_host), len(back), projections)


@pytest.mark.slow
@pytest.mark.tpu_aot
def test_libtpu_compiles_the_offload_into_host_memory():
    """A TPU compile (libtpu, no TPU needed) accepts ``outputs_offload``'s host offload: the program holds
    the offloaded projections in host memory (``Result.host_temp_bytes``, which ``k3jax.aot`` prints)."""
    pytest.importorskip("libtpu")
    from k3jax import aot
    from k3jax.config import MeshConfig

    # 2 layers (KDA with the dense FFN, MLA with the MoE), 64-token rows: libtpu's compile of the offload
    # is slow (~30 s of CPU here, a third more with a second MLA layer; the 13-layer tiny takes minutes)
    job = aot.Job("tiny", "train", "v5p-8", MeshConfig(data=1, fsdp=2, expert=2), batch=4, seq_len=64,
                  overrides=("model.remat=outputs_offload", "model.num_layers=2", "model.mla_period=2",
                             "train.batch_size=4"))
    try:
        devices = aot.TpuSlice.v5p(job.slice).devices()
    except Exception as e:  # libtpu present but unusable on this host
        pytest.skip(f"no TPU topology from libtpu: {e}")
    r = aot.compile_job(job, flops=False, devices=devices)
    assert not r.error and r.fits, r.error
    assert r.host_temp_bytes > 0
