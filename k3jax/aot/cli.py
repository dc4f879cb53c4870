"""The command line of ``python -m k3jax.aot`` (``k3jax/aot/__init__.py`` shows its uses)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys

import jax

import k3jax.aot
from k3jax.aot import compiling
from k3jax.aot.plan import PLAN, Job, rl_job
from k3jax.aot.report import breakdown_report, gib, mesh_text, rl_report, table, verdict
from k3jax.aot.slices import V5P_SHAPES, TpuSlice
from k3jax.config import ConfigError, load_config
from k3jax.sharding import LAYOUTS, parse_mesh


def _compile_on_cpu() -> None:
    """The command line's process setup (importing this module sets nothing): compiling for a TPU
    topology needs no TPU, so JAX's backends stay on the CPU (libtpu would otherwise try to claim a
    local TPU) unless ``JAX_PLATFORMS`` says otherwise, and several processes may load libtpu at once.
    A library caller of :meth:`TpuSlice.devices` sets the same (tests/conftest.py does)."""
    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")  # the variable itself is read when jax is imported
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def main(argv: list[str] | None = None) -> None:
    _compile_on_cpu()
    ap = argparse.ArgumentParser(prog="python -m k3jax.aot", description=k3jax.aot.__doc__.splitlines()[0])
    ap.add_argument("--config", help="config name or path (default: run the PLAN)")
    ap.add_argument("--mode", choices=("train", "decode", "prefill", "rl"), default="train",
                    help="rl: the RL rollout's decode step and the RL update on one mesh and one set of weights")
    ap.add_argument("--slice", default="v5p-1024", help=f"one of {', '.join(V5P_SHAPES)}")
    ap.add_argument("--mesh", default="", help="axis sizes, e.g. fsdp=8,expert=64 (unlisted axes: 1)")
    ap.add_argument("--batch", type=int, help="global rows (default: one per device for train, 1 for decode; rl: "
                    "train.rl.prompts_per_step x train.rl.group_size, which --batch may only repeat)")
    ap.add_argument("--seq-len", type=int, help="train: tokens per row (default train.seq_len); decode, prefill: "
                    "context (cache slots; default model.max_seq_len); rl: tokens per row, prompt + completion "
                    "(default train.seq_len; the rollout's cache has one slot more)")
    ap.add_argument("--prefill-chunk", type=int, default=0, help="prefill: prompt tokens per row and call, written "
                    "into the cache at a traced position (default: the whole context in one call)")
    ap.add_argument("--layout", choices=tuple(LAYOUTS), help="decode, prefill: the weights' and caches' layout "
                    "(k3jax/sharding.py; default serving: weights split once over the slice, nothing gathered per "
                    "decode step; training: FSDP storage gathered at use, the layout before the serving one)")
    ap.add_argument("--no-flops", action="store_true", help="skip the extra compile for the per-group FLOPs")
    ap.add_argument("--breakdown", nargs="?", const="", metavar="JSON", help="attribute the compiled step's FLOPs, "
                    "HBM and collective bytes to the model's parts (k3jax/aot/breakdown.py); print the table, and write "
                    "the JSON to this path if given")
    ap.add_argument("--hbm-gib", type=float, help="hold the compiler to this much HBM per device (default: the "
                    "device's); it refuses a program that does not fit")
    ap.add_argument("--write", metavar="PATH", help="also write the table to this Markdown file")
    ap.add_argument("--xla-dump", metavar="DIR", help="write XLA's dumps there (per program: the optimized HLO and "
                    "*memory-usage-report.txt, the largest buffers; written even when the program does not fit)")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.remat=dots")
    args = ap.parse_args(argv)
    if args.breakdown and "=" in args.breakdown:  # `--breakdown a.b=c`: an override taken for the JSON path
        ap.error(f"--breakdown's value {args.breakdown!r} looks like a config override: give a JSON path "
                 "(--breakdown out.json) or put --breakdown after the overrides")
    if args.layout and args.mode not in ("decode", "prefill"):
        ap.error(f"--layout applies to decode and prefill jobs; train jobs use the training layout, an rl job's "
                 f"rollout train.rl.rollout_layout's")
    if args.hbm_gib is not None and args.hbm_gib <= 0:
        ap.error(f"--hbm-gib must be positive, got {args.hbm_gib}")
    if args.xla_dump:  # read when the first backend starts, which has not happened yet
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={args.xla_dump}".strip()
    if args.config and args.mode == "rl":  # the rows come from train.rl (plan.rl_job)
        mesh = parse_mesh(args.mesh)
        try:
            job = rl_job(args.config, args.slice, mesh, args.seq_len, tuple(args.overrides), hbm_gib=args.hbm_gib)
        except ConfigError as e:
            ap.error(str(e))
        if args.batch is not None and args.batch != job.batch:
            ap.error(f"--batch {args.batch}: an rl job's rows are train.rl.prompts_per_step x train.rl.group_size = "
                     f"{job.batch}; set those instead")
        if mesh.sequence > 1 and job.seq_len % mesh.sequence:
            ap.error(f"--seq-len {job.seq_len}: the rows do not split over the mesh's sequence={mesh.sequence} shards")
        jobs = [job]
    elif args.config:
        cfg = load_config(args.config, args.overrides)
        mesh = parse_mesh(args.mesh)
        devices = TpuSlice.v5p(args.slice).num_devices
        batch = args.batch or (devices if args.mode == "train" else 1)
        seq = args.seq_len or (cfg.train.seq_len if args.mode == "train" else cfg.model.max_seq_len)
        if args.mode == "train" and mesh.sequence > 1 and seq % mesh.sequence:
            ap.error(f"--seq-len {seq}: the rows do not split over the mesh's sequence={mesh.sequence} shards")
        if args.mode == "prefill" and not 0 <= args.prefill_chunk <= seq:
            ap.error(f"--prefill-chunk {args.prefill_chunk} must be in [1, --seq-len {seq}] (0: the whole context)")
        jobs = [Job(args.config, args.mode, args.slice, mesh, batch, seq, tuple(args.overrides), hbm_gib=args.hbm_gib,
                    prefill_chunk=args.prefill_chunk if args.mode == "prefill" else 0,
                    **({"layout": args.layout} if args.layout else {}))]
    else:  # the PLAN, each job under its own budget unless --hbm-gib overrides them all
        jobs = [job if args.hbm_gib is None else dataclasses.replace(job, hbm_gib=args.hbm_gib) for job in PLAN]
    results = []
    for job in jobs:
        print(f"{job.config} {job.mode} on {job.slice} ({mesh_text(dataclasses.asdict(job.mesh))}):", flush=True)
        kwargs = dict(flops=not args.no_flops, breakdown=args.breakdown is not None, log=lambda s: print(s, flush=True))
        if job.mode == "rl":  # two programs: the rollout's decode step and the update
            rl = compiling.compile_rl(job, **kwargs)
            saved = {}
            for r in rl.phases:
                saved[r.job.phase] = _report(r, f"{r.job.phase}: ")
            text, data = rl_report(rl)
            print(text, flush=True)
            if args.breakdown:
                data = {**data, "breakdown": {k: v for k, v in saved.items() if v is not None}}
                pathlib.Path(args.breakdown).write_text(json.dumps(data, indent=1, default=float) + "\n")
            results += rl.phases
            continue
        r = compiling.compile_job(job, **kwargs)
        data = _report(r)
        if data is not None and args.breakdown:
            pathlib.Path(args.breakdown).write_text(json.dumps(data, indent=1, default=float) + "\n")
        results.append(r)
    text = table(results)
    print(text)
    if args.write:
        pathlib.Path(args.write).write_text(text + "\n")
    sys.exit(0 if all(r.fits for r in results) else 1)


def _report(r, label: str = "") -> dict | None:
    """Print one compiled program's verdict (after ``label``), memory and (with the breakdown) its per-part
    table; -> the breakdown's JSON, or None."""
    host = f", host memory {gib(r.host_temp_bytes)} GiB" if r.host_temp_bytes else ""
    resident = f" + {gib(r.resident_bytes)} GiB resident" if r.resident_bytes else ""
    print(f"  {label}{'fits' if r.fits else 'DOES NOT FIT'} ({verdict(r)}): memory_analysis {gib(r.total_bytes)} GiB"
          f"{resident}, HBM {gib(r.hbm_bytes)}{host}"
          f"{' (' + r.error + ')' if r.error else ''}; {r.compile_seconds:.0f} s", flush=True)
    if r.breakdown is None:
        return None
    text, data = breakdown_report(r)
    print(text, flush=True)
    return data


__all__ = ["main"]
