"""Shared pieces of the CPU benchmarks (decode.py, train_step.py, serve.py): the HF Kimi Linear config
matched to a k3jax config, parameter counts of the torch model under k3jax's rule (checked against
its own parameters), timing helpers, and the machine's measured float32 matmul peak and memory read
bandwidth.

Import this before jax: it pins JAX to the CPU (libtpu, when installed, must not try to claim a TPU)
and turns on the persistent compilation cache (``k3jax/runtime/compile_cache.py``; ``K3JAX_COMPILE_CACHE=off``
measures cold compiles), and makes glibc keep freed memory for the whole process, both sides of a
bench alike (``K3JAX_HOST_MEMORY=keep``, ``k3jax/runtime/host_memory.py``: XLA:CPU's and torch's large
temporaries are otherwise page-faulted in afresh on every call).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Both sides of every bench with glibc keeping freed memory (k3jax/runtime/host_memory.py), applied when k3jax is
# imported below, before jax or torch start threads.
os.environ.setdefault("K3JAX_HOST_MEMORY", "keep")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from k3jax.runtime import compile_cache  # noqa: E402
from k3jax.runtime.host_memory import keep_host_memory, keeps_host_memory  # noqa: E402

COMPILE_CACHE = compile_cache.enable()


def log(*args) -> None:
    """Progress goes to stderr; stdout carries only the JSON result."""
    print(*args, file=sys.stderr, flush=True)


def timed(fn, block) -> float:
    """Wall seconds of ``block(fn())``."""
    t0 = time.perf_counter()
    block(fn())
    return time.perf_counter() - t0


def median(xs) -> float:
    return float(statistics.median(xs))


def hf_kimi_linear_config(cfg, *, vocab_size: int | None = None):
    """A ``transformers.KimiLinearConfig`` of the same size as the k3jax ``ModelConfig`` ``cfg``.

    Equal: vocab, width, depth, layer layout (which layers are MLA), dense prefix and its FFN width,
    KDA heads / head dim / conv, MLA heads and every MLA dim, experts, top-k. Kimi Linear has no latent
    MoE, so its routed experts get the intermediate width ``expert_dim * latent_dim / hidden_size``:
    the same parameters and FLOPs per routed expert as the latent expert (``3 * latent * expert_dim``);
    HF runs its shared experts as one MLP of width ``moe_intermediate_size * n_shared_experts``, which
    is set to k3jax's ``expert_dim * num_shared_experts``. What stays different is K3-only structure:
    the latent down/up projections, the MLA output gate, the full-rank KDA output gate, AttnRes, and
    SiTU-GLU vs SwiGLU.
    """
    from transformers import KimiLinearConfig

    m = cfg.moe
    routed_width = m.expert_dim * m.latent_dim // cfg.hidden_size if m.latent_dim else m.expert_dim
    shared_total = m.expert_dim * m.num_shared_experts
    if shared_total % routed_width:
        raise ValueError(f"shared expert width {shared_total} is not a multiple of the routed width {routed_width}")
    mla_layers = [i + 1 for i in range(cfg.num_layers) if cfg.mixer(i) == "mla"]  # HF counts from 1
    kda_layers = [i + 1 for i in range(cfg.num_layers) if cfg.mixer(i) == "kda"]
    return KimiLinearConfig(
        vocab_size=vocab_size or cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        intermediate_size=cfg.dense_ffn_dim, first_k_dense_replace=cfg.first_dense_layers,
        moe_intermediate_size=routed_width, num_local_experts=m.num_experts, num_experts_per_tok=m.top_k,
        n_shared_experts=shared_total // routed_width, routed_scaling_factor=m.routed_scaling_factor,
        num_attention_heads=cfg.mla.num_heads, num_key_value_heads=cfg.mla.num_heads,
        q_lora_rank=cfg.mla.q_lora_rank or None, kv_lora_rank=cfg.mla.kv_lora_rank,
        qk_nope_head_dim=cfg.mla.qk_nope_head_dim, qk_rope_head_dim=cfg.mla.qk_rope_head_dim,
        v_head_dim=cfg.mla.v_head_dim, rms_norm_eps=cfg.norm_eps, max_position_embeddings=cfg.max_seq_len,
        linear_attn_config={"head_dim": cfg.kda.head_dim, "num_heads": cfg.kda.num_heads,
                            "short_conv_kernel_size": cfg.kda.conv_size, "kda_layers": kda_layers,
                            "full_attn_layers": mla_layers},
        tie_word_embeddings=cfg.tie_embeddings, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def torch_param_counts(model) -> dict[str, int]:
    """Total and active parameters of a torch KimiLinearForCausalLM under k3jax's rule: ``k3jax.params``'
    counts (the formulas of ``k3jax.aot.analytic``) of its architecture, its config read as k3jax reads an
    HF checkpoint's (``interop.hf_config.config_from_hf``), checked against the torch model's own
    parameters: a total that differs raises (the two models would not be the same architecture)."""
    from k3jax.interop.hf_config import config_from_hf
    from k3jax.params import count_params

    cfg, _ = config_from_hf(model.config.to_dict())
    counts = count_params(cfg)
    numel = sum(p.numel() for p in model.parameters())
    if numel != counts["total"]:
        raise ValueError(f"the torch model has {numel} parameters, k3jax.aot.analytic counts {counts['total']} "
                         f"for its config: the architectures differ")
    return {"total": counts["total"], "active": counts["active"]}


def randomize_torch(model, seed: int) -> None:
    """Every HF parameter away from its init (norm gains, gate constants, router bias), at scales that
    keep the activations O(1), so the k3jax/HF parity check cannot pass by accident."""
    import math

    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        tensors = dict(model.named_parameters())
        tensors.update({k: v for k, v in model.named_buffers() if v.is_floating_point() and "inv_freq" not in k})
        for name, p in tensors.items():
            randn = torch.randn(p.shape, generator=g)
            if name.endswith("A_log"):
                v = torch.log(1.0 + 15.0 * torch.rand(p.shape, generator=g))
            elif "norm" in name:
                v = 1.0 + 0.1 * randn
            elif p.ndim >= 2 and "embed_tokens" not in name:
                v = randn / math.sqrt(p.shape[-1])
            else:
                v = 0.1 * randn
            p.copy_(v.to(p.dtype))


@contextlib.contextmanager
def peer_host_memory(choice: str):
    """Around the peer's calls (``--peer-malloc``): ``same`` keeps this process's setting; ``glibc``
    restores glibc's defaults while inside, when the process keeps freed memory (k3jax/runtime/host_memory.py)."""
    restore = choice == "glibc" and keeps_host_memory()
    if restore:
        keep_host_memory(False)
    try:
        yield
    finally:
        if restore:
            keep_host_memory(True)


def cpu_info() -> dict:
    import jax
    import torch

    return {"cpu_cores": os.cpu_count(), "load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()],
            "host_memory_kept": keeps_host_memory(),
            "torch_threads": torch.get_num_threads(),
            "jax_backend": jax.default_backend(), "jax": jax.__version__, "torch": torch.__version__,
            "compile_cache": str(COMPILE_CACHE) if COMPILE_CACHE else "off"}


def matmul_peak(n: int = 1024, repeats: int = 10) -> dict:
    """Float32 matmul throughput of this machine under XLA: the best of ``repeats`` timed ``n^3``
    products (one jitted call runs 4 chained products, so dispatch is amortised)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)) / np.sqrt(n), jnp.float32)

    @jax.jit
    def chain(x):
        for _ in range(4):
            x = x @ a
        return x

    chain(a).block_until_ready()
    best = min(timed(lambda: chain(a), lambda y: y.block_until_ready()) for _ in range(repeats))
    return {"gflop_per_s": round(4 * 2 * n ** 3 / best / 1e9, 2), "n": n, "dtype": "float32"}


def matvec_bandwidth(size: int, mib: int = 128, repeats: int = 5, max_products: int = 1024) -> dict:
    """Weight read bandwidth of a chain of dependent float32 matrix-vector products under XLA, which is
    what a batch-1 decode step is: ``x <- tanh(x @ W_i)`` over distinct ``[size, size]`` weights of
    ``mib`` MiB in all (far larger than any cache; at most ``max_products`` of them, which bounds the
    compile: a small ``size`` gives less), the best of ``repeats`` timed chains. Each product
    waits for the one before, so a new small matrix is fetched from memory at a time: on the 2-core
    EPYC this ran at 11-13 GB/s against 33-40 GB/s for one large streaming sum (``memory_bandwidth``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    count = min(max((mib << 20) // (size * size * 4), 1), max_products)
    rng = np.random.default_rng(0)
    weights = [jnp.asarray(rng.standard_normal((size, size)) / np.sqrt(size), jnp.float32) for _ in range(count)]
    x = jnp.ones((1, size), jnp.float32)

    @jax.jit
    def chain(weights, x):
        for w in weights:
            x = jnp.tanh(x @ w)
        return x

    chain(weights, x).block_until_ready()
    best = min(timed(lambda: chain(weights, x), lambda y: y.block_until_ready()) for _ in range(repeats))
    return {"gb_per_s": round(count * size * size * 4 / best / 1e9, 2), "us_per_product": round(best / count * 1e6, 2),
            "size": size, "products": count, "how": "jitted chain of dependent float32 [1, n] @ [n, n]"}


def memory_bandwidth(mib: int = 512, repeats: int = 10) -> dict:
    """Memory read bandwidth of this machine under XLA: the best of ``repeats`` timed sums over a
    float32 array of ``mib`` MiB (far larger than any cache, so every byte comes from memory)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((mib << 18,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = min(timed(lambda: total(x), lambda y: y.block_until_ready()) for _ in range(repeats))
    return {"gb_per_s": round(x.nbytes / best / 1e9, 2), "mib": mib, "how": "jitted float32 sum"}
