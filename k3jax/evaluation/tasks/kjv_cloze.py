"""The bundled multiple-choice task ``kjv_cloze``: which four words continue a verse of the bundled
King James corpus (``k3jax/data/corpus/kjv.txt``)? The opening of a verse is the context; the
choices are its next words and the same number of words from three other verses. Built from the
corpus when the task loads (deterministic: a fixed seed), nothing is downloaded.

A smoke test of the evaluation path, not a benchmark: the demo checkpoint trained on this text
(its held-out documents included or not, as ``train.data.eval_fraction`` chose), so a trained model
scores well above the 25% of chance and an untrained one near it.
"""

from __future__ import annotations

import pathlib

import numpy as np

CORPUS = pathlib.Path(__file__).resolve().parents[2] / "data" / "corpus" / "kjv.txt"
ITEMS = 48
CHOICES = 4
ANSWER_WORDS = 4  # words in each choice
MIN_CONTEXT_WORDS = 5
SEED = 0


def verses(text: str) -> list[list[str]]:
    """Each verse's words (chapter title lines like ``Genesis 1`` and blank lines skipped)."""
    out = []
    for line in text.splitlines():
        words = line.split()
        if words and not (len(words) == 2 and words[1].isdigit()):
            out.append(words)
    return out


def items(text: str, n: int = ITEMS, seed: int = SEED) -> list[dict]:
    """``n`` items ``{"context", "choices", "label"}`` from the corpus ``text``."""
    pool = verses(text)
    long = [v for v in pool if len(v) >= MIN_CONTEXT_WORDS + ANSWER_WORDS]
    if len(long) < n * CHOICES:
        raise ValueError(f"{CORPUS}: {len(long)} verses of {MIN_CONTEXT_WORDS + ANSWER_WORDS}+ words; "
                         f"kjv_cloze needs {n * CHOICES}")
    rng = np.random.default_rng(seed)
    picked = rng.choice(len(long), size=(n, CHOICES), replace=False)  # every verse used once
    out = []
    for row in picked:
        verse = long[row[0]]
        cut = int(rng.integers(MIN_CONTEXT_WORDS, len(verse) - ANSWER_WORDS + 1))
        answer = " ".join(verse[cut:cut + ANSWER_WORDS])
        others = []
        for j in row[1:]:
            other = long[j]
            start = int(rng.integers(1, len(other) - ANSWER_WORDS + 1))  # not a verse's opening words
            others.append(" ".join(other[start:start + ANSWER_WORDS]))
        label = int(rng.integers(CHOICES))
        out.append({"context": " ".join(verse[:cut]), "choices": others[:label] + [answer] + others[label:],
                    "label": label})
    return out


def load(**kwargs) -> dict:
    """The task's dataset (lm-eval's ``custom_dataset``): a ``test`` split."""
    import datasets

    return {"test": datasets.Dataset.from_list(items(CORPUS.read_text()))}
