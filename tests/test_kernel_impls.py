"""``model.kda_impl`` / ``model.moe_impl``: the Pallas kernels (interpreted on CPU) drop into the model
and train it like the pure-JAX ops."""

import numpy as np
import pytest
from flax import nnx

from k3jax import kernels
from k3jax.config import ConfigError, load_config
from k3jax.data.pipeline import make_train_dataset
from k3jax.model import create_model
from k3jax.ops import kda as ops_kda
from k3jax.ops import moe as ops_moe
from k3jax.optim import make_optimizer
from k3jax.training.step import TrainState, make_train_step

pytestmark = pytest.mark.usefixtures("fast_xla")

# Two layers: KDA (+ dense FFN) and MLA + latent MoE, so each kernel runs in the model, forward and backward.
SMALL = ["model.num_layers=2", "train.seq_len=32", "train.batch_size=2", "train.optim.warmup_steps=1"]


def test_selection():
    import pallas_kernels.kda
    import pallas_kernels.moe

    assert kernels.chunk_kda("xla") is ops_kda.chunk_kda
    assert kernels.chunk_kda("pallas") is pallas_kernels.kda.chunk_kda
    assert kernels.grouped_glu_experts("ragged_dot") is ops_moe.grouped_glu_experts
    assert kernels.grouped_glu_experts("pallas") is pallas_kernels.moe.grouped_glu_experts
    with pytest.raises(ValueError, match="kda_impl"):
        kernels.chunk_kda("triton")
    with pytest.raises(ConfigError, match="model.moe_impl"):
        load_config("tiny", ["model.moe_impl=dense"])


def _losses(overrides, steps):
    cfg = load_config("tiny", SMALL + overrides)
    model = create_model(cfg.model, seed=0)
    with nnx.use_eager_sharding(False):
        ts = TrainState(model, make_optimizer(cfg.train.optim, model, steps))
    graphdef, state = nnx.split(ts)
    step = make_train_step(graphdef, cfg)
    it = iter(make_train_dataset(cfg.train))
    out = []
    for _ in range(steps):
        state, metrics = step(state, next(it))
        out.append(float(metrics["loss"]))
    return np.array(out)


@pytest.mark.slow
def test_pallas_kernels_train_like_xla():
    steps = 4
    xla = _losses([], steps)
    pallas = _losses(["model.kda_impl=pallas", "model.moe_impl=pallas"], steps)
    # Same math in a different order (fp32): differences are rounding, amplified a little by Muon.
    np.testing.assert_allclose(pallas, xla, rtol=2e-4)
    assert xla[-1] < xla[0]


@pytest.mark.tpu_aot
def test_auto_moe_impl_follows_the_platform_traced_for():
    """``moe_impl: auto`` is decided when traced, for the mesh's platform: a model built on the CPU host
    and traced under a one-device TPU mesh (an AOT compile) gets the Pallas grouped matmul."""
    pytest.importorskip("libtpu")
    import jax
    import jax.numpy as jnp

    from k3jax import aot

    try:
        tpu = aot.TpuSlice.v5p("v5p-8").devices()[:1]
    except Exception as e:  # libtpu present but unusable on this host
        pytest.skip(f"no TPU topology from libtpu: {e}")
    model = create_model(load_config("tiny", ["model.num_layers=2"]).model, seed=0)
    assert model.cfg.moe_impl == "auto"
    tokens = jnp.zeros((1, 8), jnp.int32)
    on_cpu = str(jax.make_jaxpr(lambda t: model(t)[0])(tokens))
    with jax.set_mesh(jax.sharding.Mesh(np.array(tpu), ("data",))):
        on_tpu = str(jax.make_jaxpr(lambda t: model(t)[0])(tokens))
    assert "ragged_dot" in on_cpu and "pallas_call" not in on_cpu
    assert "pallas_call" in on_tpu and "ragged_dot" not in on_tpu
