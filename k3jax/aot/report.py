"""What a compile reports: the Markdown table of results (per-device memory, step FLOPs, the compiler's
verdict), the per-part breakdown with its ratios and collective time at ICI bandwidth, and an rl job's
phases side by side with what stays resident between them (:func:`rl_report`)."""

from __future__ import annotations

from k3jax.aot import analytic
from k3jax.aot import breakdown as hlo_breakdown
from k3jax.aot.compiling import Result, RLResult, rl_slots
from k3jax.aot.slices import GIB, V5P_HBM_BANDWIDTH, V5P_ICI_BYTES_PER_S, V5P_PEAK_FLOPS


def breakdown_report(r: Result) -> tuple[str, dict]:
    """The per-part table (per device) and its JSON, with the step's ratios and the time of its
    collectives at v5p ICI bandwidth next to its compute at peak."""
    b, n = r.breakdown, r.num_devices
    ns = b.part_flops("newton_schulz")
    model = r.model_flops / n
    attention = sum(analytic.mixing_flops_per_token(r.job.load().model, r.job.seq_len, r.job.program).values())
    attention *= analytic.STEP_FACTOR[r.job.program] * r.tokens / n
    compute_s = b.total_flops / V5P_PEAK_FLOPS
    comm_s = sum(b.collective_bytes.values()) / V5P_ICI_BYTES_PER_S
    summary = {
        "flops_per_device": b.total_flops, "model_flops_per_device": model,
        "ratio_without_ns": (b.total_flops - ns) / model if model else float("nan"),
        "ratio_without_ns_with_attention": (b.total_flops - ns) / (model + attention) if model else float("nan"),
        "ns_flops_per_device": ns, "ns_analytic_per_device": r.ns_flops / n,
        "ns_ratio": ns / (r.ns_flops / n) if r.ns_flops else float("nan"),
        "attributed_share": b.attributed_share,
        "compute_s_at_peak": compute_s, "collective_s_at_ici": comm_s,
        "collective_bytes": dict(b.collective_bytes), "memory_gib": r.total_bytes / GIB,
        "host_memory_gib": r.host_temp_bytes / GIB,
        "data_dependent_loops": b.data_dependent_loops,
    }
    z = r.breakdown_no_overflow
    if z is not None:  # the loops whose trip count depends on the data, counted once above, not run here
        summary["without_data_dependent_loops"] = {
            "flops_per_device": z.total_flops, "collective_bytes": dict(z.collective_bytes),
            "compute_s_at_peak": z.total_flops / V5P_PEAK_FLOPS,
            "collective_s_at_ici": sum(z.collective_bytes.values()) / V5P_ICI_BYTES_PER_S}
    lines = [hlo_breakdown.table(b, r.analytic, devices=n), "",
             "| collective | GB per device | s at ICI |", "|---|---|---|"]
    lines += [f"| {k} | {v / 1e9:.2f} | {v / V5P_ICI_BYTES_PER_S:.3f} |" for k, v in sorted(b.collective_bytes.items())]
    lines += ["", f"FLOPs / (6 or 2) N_active tokens, Newton-Schulz apart: {summary['ratio_without_ns']:.2f} "
              f"({summary['ratio_without_ns_with_attention']:.2f} with attention in the denominator); "
              + (f"Newton-Schulz {summary['ns_ratio']:.2f}x its analytic count per device; " if r.ns_flops else "")
              + f"{b.attributed_share:.1%} attributed; "
              f"compute at peak {compute_s:.2f} s, collectives at ICI {comm_s:.2f} s"]
    if r.host_temp_bytes:  # offloaded residuals cross the host link twice per step (out and back)
        lines += [f"host memory {gib(r.host_temp_bytes)} GiB per device (offloaded residuals): "
                  f"{2 * r.host_temp_bytes / 1e9:.1f} GB over the host link per step, "
                  f"{2 * r.host_temp_bytes / 1e9 / compute_s:.1f} GB/s to hide behind the compute at peak"]
    if z is not None:
        w = summary["without_data_dependent_loops"]
        lines += [f"{b.data_dependent_loops:.0f} data-dependent loop runs (the dropless exchange's overflow rounds) "
                  f"counted once each above; not run (every device's pairs within a round): {w['flops_per_device']:.3e} "
                  f"FLOPs, collectives " + " / ".join(f"{k} {v / 1e9:.1f}" for k, v in sorted(w["collective_bytes"].items()))
                  + f" GB, compute at peak {w['compute_s_at_peak']:.2f} s, collectives at ICI "
                  f"{w['collective_s_at_ici']:.2f} s"]
    if r.read_bytes is not None:
        bounds = serving_bounds(r)
        summary["serving_bounds"] = bounds
        lines += ["", "| per device | compute at peak | HBM at bandwidth | collectives at ICI | must read (analytic) | "
                  "compiled HBM / analytic | output tokens/s per chip |", "|---|---|---|---|---|---|---|",
                  f"| {r.job.mode} | {bounds['compute_s'] * 1e3:.2f} ms | {bounds['hbm_s'] * 1e3:.2f} ms | "
                  f"{bounds['collective_s'] * 1e3:.2f} ms | {bounds['read_bytes'] / 1e9:.2f} GB "
                  f"({bounds['read_s'] * 1e3:.2f} ms) | {bounds['hbm_over_read']:.2f} | "
                  f"{bounds['tokens_per_s_per_chip']:.1f} ({bounds['slowest']}) |"]
    return "\n".join(lines), {**b.to_json(), "summary": summary, "analytic_per_device":
                              {k: v / n for k, v in (r.analytic or {}).items()}}


def serving_bounds(r: Result) -> dict:
    """A decode or prefill step's three lower bounds per device: its FLOPs at peak, its compiled HBM bytes at
    HBM bandwidth, its collective bytes at ICI bandwidth; the analytic bytes it must read (the weights its
    tokens touch and the cache, spread evenly over the devices: ``analytic.step_read_bytes``) next to the
    compiled HBM bytes; and the tokens per second per chip at the slowest bound (``tokens`` per step:
    one per row for decode)."""
    b, n = r.breakdown, r.num_devices
    times = {"compute": b.total_flops / V5P_PEAK_FLOPS, "hbm": sum(b.hbm_bytes.values()) / V5P_HBM_BANDWIDTH,
             "collectives": sum(b.collective_bytes.values()) / V5P_ICI_BYTES_PER_S}
    read = sum(r.read_bytes.values()) / n
    slowest = max(times, key=times.get)
    return {"compute_s": times["compute"], "hbm_s": times["hbm"], "collective_s": times["collectives"],
            "hbm_bytes": sum(b.hbm_bytes.values()), "collective_bytes": sum(b.collective_bytes.values()),
            "read_bytes": read, "read_by_kind": {k: v / n for k, v in r.read_bytes.items()},
            "read_s": read / V5P_HBM_BANDWIDTH, "hbm_over_read": sum(b.hbm_bytes.values()) / read,
            "slowest": slowest, "tokens_per_s_per_chip": r.tokens / times[slowest] / n}


def rl_report(r: RLResult) -> tuple[str, dict]:
    """An rl job's phases (per device): memory_analysis's arguments, temporaries and total, what the other
    phase keeps resident beside it and the sum, FLOPs against the model FLOPs and, with the breakdown, the
    collectives; then the resident arrays and the job's peak. The text (Markdown) and its JSON."""
    rows = ["| phase | program | argument GiB | temp GiB | total GiB | resident GiB | total with both resident GiB "
            "| fits | FLOPs/step | model FLOPs | ratio | collectives GB per device | s at ICI | compile s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    data = {}
    for p in r.phases:
        resident = resident_what(p.job)
        coll = dict(p.breakdown.collective_bytes) if p.breakdown is not None else {}
        fl = (f"{p.step_flops:.3e} | {p.model_flops:.3e} | {p.flops_ratio:.2f}" if p.step_flops else "– | – | –")
        sent = sum(coll.values())
        mem = (f"{gib(p.argument_bytes)} | {gib(p.temp_bytes)} | {gib(p.total_bytes)} | {gib(p.resident_bytes)} "
               f"({resident}) | {gib(p.resident_total_bytes)}" if not p.error else f"– | – | – | – | {p.error}")
        comm = f"{sent / 1e9:.2f} | {sent / V5P_ICI_BYTES_PER_S:.3f}" if p.breakdown is not None else "– | –"
        rows.append(f"| {p.job.phase} | {program_text(p)} | {mem} | {verdict(p)} | {fl} | {comm} | "
                    f"{p.compile_seconds:.0f} |")
        data[p.job.phase] = {
            "argument_bytes": p.argument_bytes, "output_bytes": p.output_bytes - p.alias_bytes,
            "temp_bytes": p.temp_bytes, "total_bytes": p.total_bytes, "resident_bytes": p.resident_bytes,
            "resident_total_bytes": p.resident_total_bytes, "hbm_limit_bytes": p.hbm_limit_bytes, "fits": p.fits,
            "error": p.error, "step_flops": p.step_flops, "model_flops": p.model_flops, "flops_ratio": p.flops_ratio,
            "tokens": p.tokens, "collective_bytes": coll, "compile_seconds": p.compile_seconds}
    memory = {"state_bytes": r.state_bytes, "weight_bytes": r.weight_bytes, "optimizer_bytes": r.optimizer_bytes,
              "cache_bytes": r.cache_bytes, "resident_bytes": r.resident_bytes, "peak_bytes": r.peak_bytes,
              "hbm_bytes": r.train.hbm_bytes, "rollout_layout": r.rollout_layout, "transfer_bytes": r.transfer_bytes}
    rows += ["", f"per device through both phases: train state {gib(r.state_bytes)} GiB (weights "
                 f"{gib(r.weight_bytes)}, optimizer state {gib(r.optimizer_bytes)}) + rollout cache "
                 f"{gib(r.cache_bytes)} GiB = {gib(r.resident_bytes)} GiB; peak with both resident "
                 + (f"{gib(r.peak_bytes)} / {gib(r.train.hbm_bytes)} GiB" if not (r.rollout.error or r.train.error)
                    else "– (not compiled within the budget)")]
    if r.rollout_layout != "training":
        rows.append(f"rollout in the {r.rollout_layout} layout: the weights are copied into it before each rollout by one "
                    f"reshard, {r.transfer_bytes / 1e9:.2f} GB of collectives per device "
                    f"({r.transfer_bytes / V5P_ICI_BYTES_PER_S:.3f} s at ICI), and freed before the update")
    return "\n".join(rows), {**data, "memory": memory}


def resident_what(job) -> str:
    """What an rl phase's resident bytes are: through the update the rollout engine's pool; through the rollout
    the optimizer state (a rollout on the train state's own arrays) or the whole train state (one on a copy in
    the serving layout)."""
    if job.phase != "rollout":
        return "rollout cache"
    return "optimizer state" if job.layout == "training" else "train state"


def program_text(r: Result) -> str:
    """The table's program column: what the job runs, its rows and tokens (without the note)."""
    j = r.job
    if j.mode == "rl":
        if j.phase == "rollout":
            return f"rl rollout {j.batch} x 1 @ {rl_slots(j.load().model, j.seq_len):,} slots"
        return f"rl train {j.batch} x {j.seq_len}"
    return {"train": f"train {j.batch} x {j.seq_len}", "decode": f"decode {j.batch} x 1 @ {j.seq_len:,} ctx",
            "prefill": f"prefill {j.batch} x {j.prefill_chunk or j.seq_len:,} @ {j.seq_len:,} ctx"}[j.mode]


def gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def mesh_text(shape: dict) -> str:
    return " x ".join(f"{a} {n}" for a, n in shape.items() if n > 1) or "1 device"


TABLE_HEADER = ("| config | program | slice (devices) | mesh | global batch | argument GiB | output GiB | "
                "temp GiB | total GiB / HBM | fits | FLOPs/step | model FLOPs | ratio | of which NS | compile s |")


def verdict(r: Result) -> str:
    """The fits column: the compiler's verdict, and the budget when it was below the HBM."""
    if not r.fits:
        return "no"
    return f"yes, under {gib(r.hbm_limit_bytes)}" if 0 < r.hbm_limit_bytes < r.hbm_bytes else "yes"


def table(results: list[Result]) -> str:
    """A Markdown table of per-device memory and step FLOPs (output GiB: not aliased to arguments). An rl
    phase's total counts the other phase's resident arrays too (``Result.resident_total_bytes``), named in
    its program column."""
    rows = [TABLE_HEADER, "|" + "---|" * TABLE_HEADER.count(" | ") + "---|"]
    for r in results:
        j = r.job
        what = program_text(r)
        notes = [j.note] if j.note else []
        if r.resident_bytes:
            notes.append(f"+ {gib(r.resident_bytes)} GiB {resident_what(j)} resident")
        if notes:
            what += f" ({'; '.join(notes)})"
        if r.error:
            mem = f"| – | – | – | {r.error} | no |"
        else:
            mem = (f"| {gib(r.argument_bytes)} | {gib(r.output_bytes - r.alias_bytes)} | {gib(r.temp_bytes)} | "
                   f"{gib(r.resident_total_bytes)} / {gib(r.hbm_bytes)} | {verdict(r)} |")
        if r.step_flops:
            ns = f"{r.ns_flops / r.model_flops:.2f}" if r.ns_flops else "–"
            fl = f"{r.step_flops:.3e} | {r.model_flops:.3e} | {r.flops_ratio:.2f} | {ns}"
        else:
            fl = "– | – | – | –"
        rows.append(f"| {j.config} | {what} | {j.slice} ({r.num_devices}) | {mesh_text(r.mesh_shape)} | "
                    f"{j.batch} {mem} {fl} | {r.compile_seconds:.0f} |")
    return "\n".join(rows)


__all__ = ["TABLE_HEADER", "breakdown_report", "gib", "mesh_text", "program_text", "rl_report", "table", "verdict"]
