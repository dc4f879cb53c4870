"""Generate text with a trained k3jax model: ``python infer.py [--checkpoint PATH] --prompt "..."``.

``--chat "MESSAGE"`` answers a user message instead: the prompt is the checkpoint's chat format
(``k3jax.data.chat.chat_prompt``, as a chat fine-tune was trained on) and the reply ends at its
end-of-turn token.

``--serve`` serves it instead: an OpenAI-compatible HTTP API with continuous batching
(``k3jax/serving``; ``--host``, ``--port``, ``--max-batch``, ``--max-len``, ...). On a slice of
several hosts, the same command runs on each (``--distributed``): process 0 serves the API and every
process runs its schedule of prefill and decode steps (``k3jax/serving/server.py``).

PATH is a checkpoint directory written by ``train.py`` (``<out_dir>/checkpoints``, the latest step
unless ``--step``; a LoRA run's is its base with its adapters merged) or a run directory containing one,
or a Hugging Face model directory (e.g. a ``to_hf`` / ``k3jax.convert`` export), local or a URL
(``gs://bucket/run``; ``k3jax/runtime/storage.py``). Without ``--checkpoint`` the latest run of the default main
job (``runs/default``) is used.
Tokens are streamed to the terminal as they are produced.

Weights load in the dtype the checkpoint stores (``--dtype auto``: a HF directory's config.json
``dtype`` / ``torch_dtype``, else its safetensors' dtype; bfloat16 for the releases), compressed
routed experts (MXFP4, INT4, block FP8) kept compressed and dequantized on the fly; ``--dtype float32``
or ``bfloat16`` loads in that dtype instead. The weights' bytes per device are printed at start.

Devices: ``--mesh`` lays the model out over every device of every process (default ``fsdp=-1``: the
weights split over all devices, so a model larger than one device loads); ``--distributed`` starts
the multi-host runtime (``k3jax/runtime/distributed.py``). On one device nothing is sharded.

``--image PATH`` (repeatable; a model with ``model.vision.enabled``) puts each image's placeholder
block (``<|media_begin|>image WxH<|media_content|>`` + pads + ``<|media_end|>``) before the prompt
text; the vision tower's features replace the pads in the prefill.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import k3jax  # noqa: F401 (first: with K3JAX_HOST_MEMORY=keep it sets up host memory before jax starts threads)

import jax
import numpy as np

from k3jax.runtime import compile_cache, distributed
from k3jax.training import checkpoint
from k3jax.config import ConfigError, load_config
from k3jax.data.chat import chat_prompt, reply_stop_ids
from k3jax.tokenizer import load_tokenizer
from k3jax.inference.generate import generate
from k3jax.serving.loading import DTYPES, checkpoint_dir, load_checkpoint_tokenizer, load_model, weight_bytes_line
from k3jax.serving.server import add_arguments as add_serve_arguments
from k3jax.serving.server import serve
from k3jax.sharding import SERVING_DECODE, TRAINING, make_mesh, parse_mesh, use_mesh
from pallas_kernels.platform import target_platform

DEFAULT_RUN = pathlib.Path("runs/default")


def _checkpoint_dir(path: str | None) -> pathlib.Path:
    if path is None:
        ckpt = DEFAULT_RUN / "checkpoints"
        if not ckpt.exists():
            raise SystemExit(f"no --checkpoint given and no default run at {ckpt}: train one first with "
                             f"`python train.py` (the default main job), or pass --checkpoint PATH")
        print(f"(using the latest checkpoint of the default run: {ckpt})", file=sys.stderr)
        return ckpt
    try:
        return checkpoint_dir(path)
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None


class _Printer:
    """Streams one row's tokens in step order (multi-device calls may arrive out of order), printing
    only text that decodes cleanly so far."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.printed = tokenizer, [], ""
        self.pending: dict[int, tuple[int, bool]] = {}

    def __call__(self, step, tokens, active):
        if not distributed.is_main_process():
            return
        self.pending[int(step)] = (int(tokens[0]), bool(active[0]))
        while len(self.ids) in self.pending:
            token, live = self.pending.pop(len(self.ids))
            self.ids.append(token if live else None)
        text = self.tokenizer.decode([t for t in self.ids if t is not None])
        if text.startswith(self.printed) and not text.endswith("\ufffd"):
            sys.stdout.write(text[len(self.printed):])
            sys.stdout.flush()
            self.printed = text


def _check_arguments(ap: argparse.ArgumentParser, args) -> None:
    """Reject generation settings that have no meaning (exit 2, argparse's usage error)."""
    if args.prompt is None and args.chat is None and not args.serve:
        ap.error("the following arguments are required: --prompt or --chat (or --serve)")
    if args.prompt is not None and args.chat is not None:
        ap.error("--prompt continues text and --chat answers a message: give one of them")
    if args.max_new_tokens < 1:
        ap.error(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if not args.temperature >= 0:  # also NaN
        ap.error(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        ap.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k is not None and args.top_k < 1:
        ap.error(f"--top-k must be at least 1, got {args.top_k}")
    if args.step is not None and args.step < 0:
        ap.error(f"--step must be >= 0, got {args.step}")
    if args.heartbeat_timeout is not None and args.heartbeat_timeout < 1:
        ap.error(f"--heartbeat-timeout must be at least 1 second, got {args.heartbeat_timeout}")


def main(argv: list[str] | None = None) -> None:
    compile_cache.enable()  # $K3JAX_COMPILE_CACHE or ~/.cache/k3jax/jax ("off" disables)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", help="checkpoint or run directory, a path or a URL such as gs://bucket/run "
                    "(default: runs/default)")
    ap.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    ap.add_argument("--config", help="expected config (name or path): refuse a checkpoint that does not match")
    ap.add_argument("--lora", metavar="DIR", help="LoRA adapters for the model: a LoRA run (or its checkpoint "
                    "directory) or a PEFT adapter directory; merged into the weights before decoding")
    ap.add_argument("--dtype", choices=DTYPES, default="auto", help="parameter and compute dtype (default auto: "
                    "the checkpoint's own; compressed experts stay compressed)")
    ap.add_argument("--prompt", help="the text to continue (required unless --serve)")
    ap.add_argument("--chat", metavar="MESSAGE", help="a user message to answer: rendered with the checkpoint's "
                    "chat format (the plain transcript for the byte tokenizer), generation stops at the end of the turn")
    ap.add_argument("--image", action="append", default=[], metavar="PATH",
                    help="an image shown before the prompt (repeatable; needs a vision model)")
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--top-p", type=float)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", help="'byte', a tokenizer.json or tiktoken.model (default: the checkpoint's "
                    "train.data.tokenizer; for a HF directory the tokenizer files in it)")
    ap.add_argument("--mesh", default="fsdp=-1", help="device mesh, axis=size pairs over data, fsdp, expert, "
                    "sequence, tensor (unlisted: 1; -1 fills); default: weights split over all devices")
    ap.add_argument("--distributed", choices=distributed.MODES, default="auto",
                    help="multi-host start-up (jax.distributed.initialize; k3jax/runtime/distributed.py)")
    ap.add_argument("--heartbeat-timeout", type=int, metavar="SECONDS", help="several processes: seconds without "
                    "a heartbeat before a process counts as dead and the others abort (default: JAX's, 100)")
    add_serve_arguments(ap)
    args = ap.parse_args(argv)
    _check_arguments(ap, args)  # before anything is loaded, compiled or printed
    tokenizer = None
    if args.tokenizer:  # an argument too: a bad one fails before the model loads
        try:
            tokenizer = load_tokenizer(args.tokenizer, source="--tokenizer")
        except (FileNotFoundError, ValueError) as e:
            ap.exit(2, f"error: {e}\n")
    try:
        mesh_cfg = parse_mesh(args.mesh)
    except ValueError as e:
        ap.exit(2, f"error: --mesh: {e}\n")
    try:
        expected = load_config(args.config) if args.config else None
    except ConfigError as e:  # the message names the field: no traceback
        ap.exit(2, f"error: {e}\n")

    distributed.initialize(args.distributed, args.heartbeat_timeout)
    try:
        mesh = make_mesh(mesh_cfg)
    except ValueError as e:
        ap.exit(2, f"error: --mesh: {e}\n")
    placement = mesh if mesh.size > 1 else None
    if target_platform(mesh) == "cpu":
        jax.config.update("jax_disable_most_optimizations", True)  # see train.py: compile time on CPU
    ckpt = _checkpoint_dir(args.checkpoint)
    # The server's engine decodes in the serving layout (k3jax/sharding.py): the weights load straight into it,
    # each device reading its own shards. One-shot generation is one program, prefill and decode, in training's.
    layout = SERVING_DECODE if args.serve else TRAINING
    try:  # a LoRA run's or --lora's adapters come merged: decoding reads the merged weights (no extra matmuls)
        with layout.active():
            model, cfg = load_model(ckpt, step=args.step, config=expected, mesh=placement, lora=args.lora,
                                    dtype=args.dtype)
        if tokenizer is None:
            tokenizer = load_checkpoint_tokenizer(ckpt, cfg)
    except (checkpoint.CheckpointError, FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    print(weight_bytes_line(model), file=sys.stderr, flush=True)  # every process: its own devices
    if args.serve:
        return serve(model, tokenizer, args, name=cfg.name, mesh=mesh)
    images = None
    if args.image:
        if not cfg.model.vision.enabled:
            raise SystemExit("--image needs a model with a vision tower (model.vision.enabled), e.g. "
                             "`python train.py --config tiny_vl`")
        from k3jax.vision.inputs import pack_images
        from k3jax.vision.processor import build_tokens

        try:
            prompt, processed = build_tokens([*map(pathlib.Path, args.image), args.prompt], cfg.model.vision,
                                             tokenizer.encode)
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: cannot read image: {e}") from None
        images = pack_images([processed], cfg.model.vision.merge_size)
    elif args.chat is not None:
        prompt = chat_prompt(tokenizer, [{"role": "user", "content": args.chat}])
    else:
        prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise SystemExit("the prompt is empty after tokenisation")
    if max(prompt) >= cfg.model.vocab_size:
        raise SystemExit(f"prompt token id {max(prompt)} is outside the model's vocabulary ({cfg.model.vocab_size})")
    room = cfg.model.max_seq_len - len(prompt)
    if room <= 0:
        raise SystemExit(f"the prompt has {len(prompt)} tokens; the model's context is {cfg.model.max_seq_len}")
    max_new = min(args.max_new_tokens, room)
    if args.chat is not None:
        stops = reply_stop_ids(tokenizer)
        shown = f"user: {args.chat}\nassistant:"
    else:
        stops = tuple(getattr(tokenizer, "stop_ids", ())) or ((tokenizer.eos_id,) if tokenizer.eos_id is not None else ())
        shown = args.prompt
    if distributed.is_main_process():
        sys.stdout.write(shown)
        sys.stdout.flush()
    with use_mesh(mesh):
        jax.block_until_ready(generate(model, np.asarray([prompt], np.int32), max_new, temperature=args.temperature,
                                       top_k=args.top_k, top_p=args.top_p, stop_tokens=stops, seed=args.seed,
                                       stream=_Printer(tokenizer), images=images))
    if distributed.is_main_process():
        sys.stdout.write("\n")


if __name__ == "__main__":
    main()
