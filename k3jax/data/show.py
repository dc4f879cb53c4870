"""What the loss covers: ``python -m k3jax.data.show --config NAME [-n N] [--split eval] [key=value ...]``.

Prints the data counts (for chat data, the start-of-run scan: conversations kept, truncated, dropped,
skipped, tokens trained) and the first ``N`` examples of the split as the pipeline makes them (after
truncation, before packing), with the trained tokens marked: green on a terminal, ``[[...]]`` otherwise
(``--color``). A marked token is one the loss predicts (the mask sits on the target). Control
characters are shown as their Unicode pictures (the transcript's end-of-turn byte 0x04 as ``␄``).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from k3jax.config import ConfigError, load_config
from k3jax.data.chat import ConversationToPieces, open_conversations
from k3jax.data.pipeline import DocumentToPieces, report_chat_counts, split_indices
from k3jax.data.sources import open_documents
from k3jax.tokenizer import load_tokenizer

GREEN, RESET = "\x1b[32;1m", "\x1b[0m"
BRACKETS = ("[[", "]]")
CONTROL_PICTURES = {i: chr(0x2400 + i) for i in range(32) if chr(i) not in "\n\t"}


def visible(text: str) -> str:
    """Control characters (but newline and tab) as their Unicode pictures (U+2400 + code)."""
    return text.translate(CONTROL_PICTURES)


def mark_example(example: dict[str, np.ndarray], decode, color: bool) -> str:
    """The example's tokens (its first input, then the targets) with the runs of trained targets
    marked."""
    ids = [int(example["inputs"][0])] + [int(t) for t in example["targets"]]
    trained = [False] + [bool(m > 0) for m in example["loss_mask"]]
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or trained[i] != trained[start]:
            text = visible(decode(ids[start:i]))
            if trained[start]:
                text = f"{GREEN}{text}{RESET}" if color else f"{BRACKETS[0]}{text}{BRACKETS[1]}"
            out.append(text)
            start = i
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny", help="config name (configs/<name>.yaml) or YAML path")
    ap.add_argument("-n", type=int, default=3, help="examples to print")
    ap.add_argument("--split", choices=("train", "eval"), default="train")
    ap.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                    help="mark trained tokens in colour (auto: when stdout is a terminal) or with [[...]]")
    ap.add_argument("overrides", nargs="*", help="dotted key=value config overrides, e.g. train.data.format=chat")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        show(cfg, args.n, args.split, color=args.color == "always" or (args.color == "auto" and sys.stdout.isatty()))
    except (ValueError, FileNotFoundError) as e:  # a bad record, a missing file: one line, as train.py does
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def show(cfg, n: int, split: str, *, color: bool) -> None:
    """Print the counts and the first ``n`` examples of ``split`` of ``cfg``'s data (module docstring)."""
    data, seq_len = cfg.train.data, cfg.train.seq_len
    tokenizer = load_tokenizer(data.tokenizer)
    if data.format == "chat":
        records = open_conversations(data.source)
        to_pieces = ConversationToPieces(tokenizer, seq_len, data.chat_loss, data.chat_overflow)
        report_chat_counts(records, to_pieces, data.eval_fraction, data.source)
    else:
        records = open_documents(data.source, data.format, data.text_field)
        to_pieces = DocumentToPieces(tokenizer, seq_len)
        print(f"text data {data.source}: {len(records)} documents, every token trained "
              f"(pieces of at most seq_len={seq_len} tokens)")
    shown = 0
    for i in split_indices(len(records), data.eval_fraction, split):
        if shown >= n:
            break
        for example in to_pieces.flat_map(records[int(i)])[:n - shown]:
            trained = int(example["loss_mask"].sum())
            print(f"\n--- {split} example {shown} (record {int(i)}): {len(example['targets'])} tokens, "
                  f"{trained} trained ---")
            print(mark_example(example, tokenizer.decode, color))
            shown += 1


if __name__ == "__main__":
    sys.exit(main())
