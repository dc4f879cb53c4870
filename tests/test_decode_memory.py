"""The decoding cache of the scanned layer groups is updated in place: a decode step's temporaries do not
grow with the model's depth (before, the scan's xs -> ys copy held a second copy of every scanned layer's
cache: 22 GiB per device for full K3 at 1M tokens), and its MLA layers read their caches where they lie and
write only the new slots (before, each layer's slice was read out of the stack and written back whole, and
its ``[c_kv | k_rope]`` concatenation and a block-major copy for the key loop were made: 7.7x the cache's
bytes of HBM traffic).

Compiled for a v5p slice with libtpu (no TPU needed), ``tiny`` with K3's MLA cache widths in bf16.
"""

import functools
import os

import pytest

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
pytest.importorskip("libtpu")

from k3jax import aot  # noqa: E402
from k3jax.config import MeshConfig, load_config  # noqa: E402

pytestmark = pytest.mark.tpu_aot

SLICE, MESH = "v5p-16", MeshConfig(expert=8)
K3_CACHE = ("model.dtype=bfloat16", "model.param_dtype=bfloat16", "model.mla.kv_lora_rank=512",
            "model.mla.qk_rope_head_dim=64", "model.max_seq_len=32768")


BATCH, SLOTS = 8, 32768


def compile_decode(job: aot.Job) -> aot.Result:
    """``job`` compiled for its v5p slice with the breakdown (skipped where libtpu gives no topology); it
    must fit."""
    try:
        devices = aot.TpuSlice.v5p(job.slice).devices()
    except Exception as e:  # libtpu present but unusable on this host
        pytest.skip(f"no TPU topology from libtpu: {e}")
    r = aot.compile_job(job, flops=False, breakdown=True, devices=devices)
    assert not r.error and r.fits, r.error
    return r


@functools.cache
def _decode(num_layers: int) -> aot.Result:
    return compile_decode(aot.Job("tiny", "decode", SLICE, MESH, batch=BATCH, seq_len=SLOTS,
                                  overrides=K3_CACHE + (f"model.num_layers={num_layers}",)))


def test_decode_temporaries_do_not_grow_with_depth():
    shallow, deep = _decode(13), _decode(25)  # 2 and 5 MLA layers in the scanned groups
    added_cache = deep.argument_bytes - shallow.argument_bytes  # 12 more layers' caches (and weights)
    assert added_cache > 0
    # xs -> ys held one more copy of every added scanned layer's cache: about added_cache more temporaries
    assert deep.temp_bytes - shallow.temp_bytes < 0.25 * added_cache, (shallow.temp_bytes, deep.temp_bytes,
                                                                        added_cache)


def test_decode_reads_each_mla_cache_where_it_lies():
    """The MLA layers' HBM traffic of a decode step is their caches read (c_kv twice: by the scores and by
    the weighted values, two XLA fusions) and the new slots written, not copies of the caches."""
    r = _decode(13)
    cfg = load_config("tiny", list(K3_CACHE) + ["model.num_layers=13"]).model
    mla_layers = sum(cfg.mixer(i) == "mla" for i in range(cfg.num_layers))
    cache = mla_layers * BATCH * SLOTS * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * 2 / MESH.expert
    traffic = sum(v for (part, _), v in r.breakdown.hbm_bytes.items() if part == "mla")
    assert traffic < 2.5 * cache, (traffic / cache, traffic, cache)  # 7.7x with the copies
