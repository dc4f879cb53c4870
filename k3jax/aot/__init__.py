"""Scale tooling: ahead-of-time compiles for TPU pod slices on a CPU-only host (the proof that a config
fits), and the step's FLOPs counted two ways: analytically from the config and from the compiled HLO.

::

    python -m k3jax.aot --write table.md                  # the PLAN below (docs/scale.md holds its table)
    python -m k3jax.aot --config k3 --mode train --slice v5p-2048 --mesh fsdp=4,sequence=4,expert=64 --batch 256 \
        train.batch_size=256 model.remat=full model.moe.ep_capacity_factor=2.0 train.optim.muon_dtype=bfloat16
    python -m k3jax.aot --config k3 --mode decode --slice v5p-128 --mesh expert=64 --batch 1 --seq-len 1048576
    python -m k3jax.aot --config k3 --mode prefill --slice v5p-128 --mesh expert=64 --seq-len 1048576 \
        --prefill-chunk 16384

``jax[tpu]`` ships libtpu, whose compiler runs without a TPU: ``get_topology_desc`` describes the
devices of a slice, a mesh is built on them (``k3jax.sharding.make_mesh``), and the *real* programs
are lowered from ``ShapeDtypeStruct`` arguments that carry the rule-derived shardings and compiled:

- ``train``: ``k3jax.training.step.make_train_step`` over the split ``TrainState`` (model, per-head Muon +
  AdamW state, step counters), built abstractly (``abstract_model`` + ``jax.eval_shape``: nothing is
  allocated, the full K3 state builds in about a second), state donated.
- ``decode``: one token of ``model(tokens, cache=cache)`` (the step ``k3jax.generate`` loops over)
  against a cache of ``seq_len`` slots (``model.init_cache``), cache donated.
- ``prefill``: ``prefill_chunk`` prompt tokens per row of the same call, written into (and attending
  over) a cache of ``seq_len`` slots: the program the serving engine's chunked prefill runs
  ``seq_len / prefill_chunk`` times for a full-length prompt (the cache position is traced, so every
  chunk is this program; the last one attends over the whole context).

- ``slices``: v5p slices (chips, HBM, peak FLOP/s, ICI bandwidth) and their libtpu device descriptions;
- ``plan``: a job (config, program, slice, mesh, batch) and the PLAN of the scale proof (docs/scale.md);
- ``compiling``: lowering and compiling a job under an HBM budget, and its FLOPs with loop trip counts;
- ``analytic``: the analytic model (parameters and FLOPs per part, attention terms, Newton-Schulz);
- ``breakdown``: the compiled step's FLOPs, HBM and collective bytes by model part (``--breakdown``);
- ``report``: the Markdown table of results and the per-part breakdown report;
- ``cli``: ``python -m k3jax.aot``.
"""

from k3jax.aot.compiling import Result, abstract_batch, compile_job, job_model, lower_decode, lower_train, without_groups
from k3jax.aot.plan import PLAN, Job
from k3jax.aot.report import breakdown_report, table
from k3jax.aot.slices import GIB, V5P_HBM_BYTES, TpuSlice
from k3jax.aot.cli import main  # after the modules it uses

__all__ = ["GIB", "PLAN", "V5P_HBM_BYTES", "Job", "Result", "TpuSlice", "abstract_batch", "breakdown_report",
           "compile_job", "job_model", "lower_decode", "lower_train", "main", "table", "without_groups"]
