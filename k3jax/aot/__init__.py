"""Scale tooling: ahead-of-time compiles for TPU pod slices on a CPU-only host (the proof that a config
fits), and the step's FLOPs counted two ways: analytically from the config and from the compiled HLO.

::

    python -m k3jax.aot --write table.md                  # the PLAN below (docs/scale.md holds its table)
    python -m k3jax.aot --config k3 --mode train --slice v5p-2048 --mesh fsdp=4,sequence=4,expert=64 --batch 256 \
        train.batch_size=256 model.remat=full model.moe.ep_capacity_factor=2.0 train.optim.muon_dtype=bfloat16
    python -m k3jax.aot --config k3 --mode decode --slice v5p-128 --mesh expert=64 --batch 1 --seq-len 1048576
    python -m k3jax.aot --config k3 --mode prefill --slice v5p-128 --mesh expert=64 --seq-len 1048576 \
        --prefill-chunk 16384
    python -m k3jax.aot --config k3 --mode rl --slice v5p-128 --mesh expert=64 --seq-len 36864 --breakdown rl.json \
        train.rl.loss=grpo train.rl.group_size=16 train.rl.prompts_per_step=4 train.rl.max_new_tokens=32768 \
        train.lora.rank=16 "train.lora.targets=[mla,kda,shared]" quant.experts=mxfp4 model.param_dtype=bfloat16 \
        model.remat=full model.moe.ep_capacity_factor=2.0

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
- ``rl``: reinforcement learning's two programs on one mesh and one set of weight arrays (``k3jax.rl.trainer``),
  for ``train.rl.prompts_per_step x group_size`` rows of ``seq_len`` tokens (prompt + completion): the
  rollout, the serving engine's decode step (``k3jax.serving.programs.decode_program``: routes and sampled
  log-probabilities recorded) of every row against the engine's pool of ``seq_len + 1`` slots, on the train
  state's weights (a LoRA config's adapters with its frozen base) in ``train.rl.rollout_layout`` (serving: a copy
  made by one reshard per rollout, whose collectives are reported); and the update, ``k3jax.rl.step.make_rl_step``
  on ``[rows, seq_len]`` rows with the rollout's experts replayed. Each is compiled under the HBM budget
  less what the other keeps resident (the optimizer or whole train state through the rollout, the engine's
  pool through the update), and reported with it (``compiling.compile_rl``, ``report.rl_report``).

- ``slices``: v5p slices (chips, HBM, peak FLOP/s, ICI bandwidth) and their libtpu device descriptions;
- ``plan``: a job (config, program, slice, mesh, batch), an rl job from its config, and the PLAN of the scale
  proof (docs/scale.md);
- ``compiling``: lowering and compiling a job under an HBM budget, and its FLOPs with loop trip counts;
- ``analytic``: the analytic model (parameters and FLOPs per part, attention terms, Newton-Schulz);
- ``breakdown``: the compiled step's FLOPs, HBM and collective bytes by model part (``--breakdown``);
- ``report``: the Markdown table of results and the per-part breakdown report;
- ``cli``: ``python -m k3jax.aot``.
"""

from k3jax.aot.compiling import (RLResult, Result, abstract_batch, abstract_rl_batch, compile_job, compile_rl,
                                 job_model, lower_decode, lower_rl_rollout, lower_rl_train, lower_train, without_groups)
from k3jax.aot.plan import PLAN, Job, rl_job
from k3jax.aot.report import breakdown_report, rl_report, table
from k3jax.aot.slices import GIB, V5P_HBM_BYTES, TpuSlice
from k3jax.aot.cli import main  # after the modules it uses

__all__ = ["GIB", "PLAN", "V5P_HBM_BYTES", "Job", "RLResult", "Result", "TpuSlice", "abstract_batch",
           "abstract_rl_batch", "breakdown_report", "compile_job", "compile_rl", "job_model", "lower_decode",
           "lower_rl_rollout", "lower_rl_train", "lower_train", "main", "rl_job", "rl_report", "table",
           "without_groups"]
