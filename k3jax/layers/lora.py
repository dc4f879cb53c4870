"""Low-rank adapters (LoRA) beside the frozen projections (docs/design.md "LoRA").

A targeted weight ``W [*in, *out]`` (``x @ W`` layout, head axes kept) gets ``A [*in, r]`` and
``B [r, *out]``: the adapters mirror the weight, so the HF orientation rules of a weight apply to them
unchanged (``A`` is a weight whose output is ``r``, ``B`` one whose input is ``r``), and PEFT's
``lora_A.weight [r, in]`` / ``lora_B.weight [out, r]`` come out of ``k3jax.interop.hf_names``.

The low-rank path runs on the activation side of the base matmul, ``y = x W + s (dropout(x) A) B``:
the weight is read through ``initializers.cast`` as before (whatever container holds it), and with ``W``
outside the differentiated state no weight-shaped gradient is formed. MLA's ``kv_b`` is read as a weight
(split into ``W_UK`` / ``W_UV`` and folded into the query by the absorbed attention): there the layer
uses the merged weight ``W + s A B`` (:func:`weight`), small (``kv_lora x H x (nope + v)``) and exact in
both attention forms; its adapter's input is therefore never dropped out.

Adapters live in a ``lora`` dict of the module holding the weight (``mixer.lora.q_b.a``), stacked like the
weight in scanned layer groups (leading ``layers`` axis). They are :class:`LoRAParam` variables, the only
ones a LoRA run differentiates and gives optimizer state.
"""

from __future__ import annotations

import math
import string
import zlib

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import LoRAConfig
from k3jax.layers.initializers import cast, constant, param, uniform

# Logical axis of the adapters' rank (not in the sharding rules: replicated).
RANK_AXIS = "lora_rank"


class LoRAParam(nnx.Param):
    """A low-rank adapter factor: the trainable parameters of a LoRA run (the model's own stay frozen)."""


class Adapter(nnx.Module):
    """``A [*lead, *in, r]``, ``B [*lead, r, *out]`` of one weight ``[*lead, *in, *out]`` (``lead``: the
    ``layers`` axis of a scanned group, absent inside the scan), the scale ``s``, the dropout rate of its
    input and the number of input axes."""

    def __init__(self, a: LoRAParam, b: LoRAParam, *, scale: float, dropout: float, num_in: int):
        self.a, self.b = a, b
        self.scale, self.dropout, self.num_in = scale, dropout, num_in

    def delta(self, x: jax.Array, spec: str, dtype, key: jax.Array | None) -> jax.Array:
        """The low-rank path ``s (dropout(x) A) B`` of the base product ``einsum(spec, x, W)``."""
        if key is not None and self.dropout > 0:
            keep = jax.random.bernoulli(key, 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), jnp.zeros((), x.dtype)).astype(x.dtype)
        a_spec, b_spec = low_rank_specs(spec)
        h = jnp.einsum(a_spec, x, cast(self.a, dtype))
        return jnp.einsum(b_spec, (h * self.scale).astype(dtype), cast(self.b, dtype))

    def product(self) -> jax.Array:
        """``s A B`` in float32, shaped like the weight ``[*lead, *in, *out]``."""
        a, b = self.a[...].astype(jnp.float32), self.b[...].astype(jnp.float32)
        n_lead = a.ndim - self.num_in - 1
        lead, r = a.shape[:n_lead], a.shape[-1]
        ab = a.reshape(*lead, -1, r) @ b.reshape(*lead, r, -1)
        return self.scale * ab.reshape(*lead, *a.shape[n_lead:-1], *b.shape[n_lead + 1:])


def low_rank_specs(spec: str) -> tuple[str, str]:
    """The two einsums of the low-rank path of ``spec`` (``"x_dims,w_dims->out_dims"``, the weight's input
    dims first): ``"btd,dhk->bthk"`` -> (``"btd,dr->btr"``, ``"btr,rhk->bthk"``)."""
    inputs, out = spec.replace(" ", "").split("->")
    xs, ws = inputs.split(",")
    contracted = "".join(c for c in ws if c not in out)
    if not ws.startswith(contracted):
        raise ValueError(f"einsum {spec!r}: the weight's contracted dims must come first")
    r = next(c for c in string.ascii_letters if c not in spec)
    kept = "".join(c for c in xs if c not in contracted)
    return f"{xs},{contracted}{r}->{kept}{r}", f"{kept}{r},{r}{ws[len(contracted):]}->{out}"


def adapter(module: nnx.Module, name: str) -> Adapter | None:
    """The adapter of ``module``'s weight ``name``, or None."""
    adapters = getattr(module, "lora", None)
    return adapters[name] if adapters is not None and name in adapters else None


def project(module: nnx.Module, name: str, x: jax.Array, spec: str, dtype, key: jax.Array | None = None) -> jax.Array:
    """``einsum(spec, x, W)`` for ``W = module.<name>`` in ``dtype``, plus its adapter's low-rank path
    (with its input dropped out under ``key``, a layer's dropout key, when the rate is positive)."""
    y = jnp.einsum(spec, x, cast(getattr(module, name), dtype))
    ad = adapter(module, name)
    if ad is None:
        return y
    return y + ad.delta(x, spec, dtype, None if key is None else site_key(key, name))


def weight(module: nnx.Module, name: str, dtype) -> jax.Array:
    """``module.<name>`` in ``dtype``, merged with its adapter (``W + s A B``) when it has one."""
    w = cast(getattr(module, name), dtype)
    ad = adapter(module, name)
    return w if ad is None else (w + ad.product().astype(dtype))


def site_key(key: jax.Array, name: str) -> jax.Array:
    """The dropout key of one weight's adapter from its layer's key (a fixed function of the name)."""
    return jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)


def _input_axes(axes: tuple) -> int:
    """How many leading axes of a weight (after ``layers``) are its input: two for output projections
    ``(heads, head_dim, d)`` (the rule of ``k3jax.optim``), one otherwise."""
    return 2 if axes[:2] == ("heads", "head_dim") else 1


def attach(module: nnx.Module, names, cfg: LoRAConfig, rngs: nnx.Rngs) -> None:
    """Give ``module`` adapters for those of its weights ``names`` it has (in place): ``A`` ~ PEFT's
    default kaiming-uniform ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, ``B = 0``, float32 whatever the
    weight's dtype. Under ``initializers.abstract_init`` they are shapes only."""
    adapters = {}
    for name in sorted(names):
        w = getattr(module, name, None)
        if w is None:
            continue
        axes = tuple(w.get_metadata()["out_sharding"])
        shape = tuple(w.get_raw_value().shape)
        lead = 1 if axes[0] == "layers" else 0
        n_in = _input_axes(axes[lead:])
        cut = lead + n_in
        a_shape, b_shape = (*shape[:cut], cfg.rank), (*shape[:lead], cfg.rank, *shape[cut:])
        bound = 1.0 / math.sqrt(math.prod(shape[lead:cut]))
        a = param(a_shape, (*axes[:cut], RANK_AXIS), jnp.float32,
                  lambda s=a_shape, b=bound: uniform(rngs, s, -b, b), kind=LoRAParam)
        b = constant(0.0, b_shape, (*axes[:lead], RANK_AXIS, *axes[cut:]), jnp.float32, kind=LoRAParam)
        adapters[name] = Adapter(a, b, scale=cfg.scale, dropout=cfg.dropout, num_in=n_in)
    if adapters:
        module.lora = nnx.Dict(adapters)


def merge(module: nnx.Module) -> None:
    """Fold ``module``'s adapters into its weights (``W <- W + s A B``, rounded once to W's dtype) and
    drop them (in place)."""
    adapters = getattr(module, "lora", None)
    if adapters is None:
        return
    for name in list(adapters):
        w = getattr(module, name)
        if not isinstance(w, nnx.Param) or not jnp.issubdtype(w[...].dtype, jnp.floating):
            raise TypeError(f"cannot merge a LoRA adapter into {type(module).__name__}.{name}: not a float "
                            f"parameter ({type(w).__name__})")
        w[...] = (w[...].astype(jnp.float32) + adapters[name].product()).astype(w[...].dtype)
    del module.lora


__all__ = ["RANK_AXIS", "Adapter", "LoRAParam", "adapter", "attach", "low_rank_specs", "merge", "project",
           "site_key", "weight"]
