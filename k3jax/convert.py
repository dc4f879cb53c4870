"""Convert checkpoints between Hugging Face safetensors and k3jax Orbax checkpoints.

    python -m k3jax.convert --from-hf HF_DIR --to-orbax OUT_DIR [--dtype bfloat16]
    python -m k3jax.convert --from-orbax CKPT_DIR --to-hf OUT_DIR --model-type kimi_k3 \
        [--max-shard-size 5GB] [--dtype bfloat16] [--mxfp4] [--tokenizer-from HF_DIR]
    python -m k3jax.convert --from-orbax LORA_RUN --to-peft OUT_DIR --model-type kimi_linear

LoRA: a LoRA run's checkpoint (``train.lora``) read with ``--from-orbax`` is its base with the adapters;
``--lora DIR`` adds the adapters of a LoRA run or a PEFT adapter directory to the model read. ``--to-hf``
and ``--to-orbax`` merge the adapters into the weights (``W + s A B``); ``--to-peft`` writes the adapters
alone in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``) for the HF model of
``--model-type``.

``--from-hf`` reads ``kimi_k3``, ``kimi_linear``, ``deepseek_v3`` and ``kimi_k2`` directories
(config.json + single or sharded safetensors), streaming shard by shard. ``--to-hf`` writes the
official layout of ``--model-type``; ``--tokenizer-from`` copies the tokenizer files and the
special-token ids of an original download into the export. Every path may be a URL (``gs://bucket/ckpt``;
``k3jax/runtime/storage.py``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py", "chat_template.jinja",
                   "generation_config.json", "special_tokens_map.json", "tokenizer.json", "encoding_k3.py")


def _checkpoints(src: str):
    """A run directory's ``checkpoints/``, else ``src`` itself (a local path or a URL)."""
    from k3jax.runtime import storage

    p = storage.path(src)
    return p / "checkpoints" if (p / "checkpoints").is_dir() else p


def _with_lora(model, lora: str | None):
    """``model`` with the adapters of ``lora`` (a LoRA run or a PEFT directory) added, when given."""
    if lora:
        from k3jax.training.checkpoint import restore_adapters

        restore_adapters(model, lora)
    return model


def hf_to_orbax(src: str, dst: str, *, dtype: str = "float32", overrides=(), lora: str | None = None,
                progress: bool = True) -> None:
    import jax.numpy as jnp

    from k3jax.training.checkpoint import save_model
    from k3jax.config import Config
    from k3jax.interop import from_hf

    model = _with_lora(from_hf(src, dtype=jnp.dtype(dtype), overrides=overrides, progress=progress), lora)
    model.merge_lora()
    config = Config.of_model(model.cfg, pathlib.PurePosixPath(str(src).rstrip("/")).name)
    save_model(dst, model, config)


def orbax_to_orbax(src: str, dst: str, *, lora: str | None = None, step: int | None = None) -> None:
    """A plain checkpoint of a LoRA run (or of ``src`` with ``lora``'s adapters), the adapters merged."""
    import dataclasses

    from k3jax.training.checkpoint import restore_model, save_model
    from k3jax.config import LoRAConfig

    model, config = restore_model(_checkpoints(src), step=step)
    model = _with_lora(model, lora)
    if model.lora_config is None:
        raise ValueError(f"{src} has no LoRA adapters to merge (pass --lora DIR, or convert a LoRA run)")
    model.merge_lora()
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, lora=LoRAConfig(), init_from=None))
    save_model(dst, model, config)


def orbax_to_peft(src: str, dst: str, *, model_type: str, lora: str | None = None, step: int | None = None) -> None:
    """The adapters of a LoRA run (or ``lora``'s on ``src``) as a PEFT adapter directory."""
    from k3jax.training.checkpoint import restore_model
    from k3jax.interop.peft import save_peft

    model, _ = restore_model(_checkpoints(src), step=step)
    save_peft(_with_lora(model, lora), dst, model_type=model_type, base_model_name_or_path=None)


def orbax_to_hf(src: str, dst: str, *, model_type: str, max_shard_size: str = "5GB", dtype: str | None = None,
                mxfp4: bool | None = None, tokenizer_from: str | None = None, step: int | None = None,
                lora: str | None = None, progress: bool = True) -> None:
    from k3jax.runtime import storage
    from k3jax.training.checkpoint import restore_model
    from k3jax.interop import to_hf

    model, _ = restore_model(_checkpoints(src), step=step)
    _with_lora(model, lora).merge_lora()
    extra = {}
    if tokenizer_from:
        src_cfg = storage.path(tokenizer_from) / "config.json"
        if src_cfg.exists():
            hf = json.loads(storage.read_text(src_cfg))
            for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if k in hf:
                    extra[k] = hf[k]
                elif k in (hf.get("text_config") or {}):
                    extra[k] = hf["text_config"][k]
    to_hf(model, dst, model_type=model_type, max_shard_size=max_shard_size, dtype=dtype, mxfp4_experts=mxfp4,
          extra_config=extra, progress=progress)
    if tokenizer_from:
        for name in TOKENIZER_FILES:
            f = storage.path(tokenizer_from) / name
            if f.exists():
                storage.write_bytes(storage.path(dst) / name, storage.read_bytes(f))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3jax.convert", description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="DIR", help="Hugging Face model directory")
    src.add_argument("--from-orbax", metavar="DIR", help="k3jax Orbax checkpoint directory")
    dst = ap.add_mutually_exclusive_group(required=True)
    dst.add_argument("--to-orbax", metavar="DIR")
    dst.add_argument("--to-hf", metavar="DIR")
    dst.add_argument("--to-peft", metavar="DIR", help="the LoRA adapters alone, in PEFT's format")
    ap.add_argument("--model-type", default="kimi_k3", choices=["kimi_k3", "kimi_linear", "deepseek_v3", "kimi_k2"],
                    help="layout written by --to-hf (default kimi_k3)")
    ap.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: float32 on import, the "
                    "parameter dtype on export)")
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument("--mxfp4", action=argparse.BooleanOptionalAction, default=None,
                    help="write routed experts MXFP4-packed (kimi_k3; default: only if they were loaded packed)")
    ap.add_argument("--tokenizer-from", metavar="DIR", help="copy tokenizer files and token ids from this HF dir")
    ap.add_argument("--step", type=int, default=None, help="Orbax step to export (default: latest)")
    ap.add_argument("--lora", metavar="DIR", help="add the adapters of a LoRA run or PEFT directory (merged, "
                    "except with --to-peft)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("overrides", nargs="*", help="model config overrides for --from-hf (e.g. kda.chunk_size=16)")
    args = ap.parse_args(argv)
    progress = not args.no_progress
    if args.from_hf and args.to_orbax:
        hf_to_orbax(args.from_hf, args.to_orbax, dtype=args.dtype or "float32", overrides=args.overrides,
                    lora=args.lora, progress=progress)
    elif args.from_orbax and args.to_hf:
        orbax_to_hf(args.from_orbax, args.to_hf, model_type=args.model_type, max_shard_size=args.max_shard_size,
                    dtype=args.dtype, mxfp4=args.mxfp4, tokenizer_from=args.tokenizer_from, step=args.step,
                    lora=args.lora, progress=progress)
    elif args.from_orbax and args.to_orbax:
        orbax_to_orbax(args.from_orbax, args.to_orbax, lora=args.lora, step=args.step)
    elif args.from_orbax and args.to_peft:
        orbax_to_peft(args.from_orbax, args.to_peft, model_type=args.model_type, lora=args.lora, step=args.step)
    else:
        ap.error("convert --from-hf to --to-orbax, or --from-orbax to --to-hf, --to-peft or (merging LoRA) "
                 "--to-orbax")
    print(f"wrote {args.to_orbax or args.to_hf or args.to_peft}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
