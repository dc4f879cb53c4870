"""Write ``chat.jsonl`` beside this file: the bundled chat set, questions and answers about ``kjv.txt``.

``python k3jax/data/corpus/make_chat.py`` (deterministic: a fixed seed, the text only; rerunning it
rewrites the same bytes). Every answer is a short span of the text or a fact read off its layout (one
chapter per blank-line block, a title line ``Book N``, one verse per line), so a small model trained on
the corpus can learn them. Kinds of conversation (one or two user turns, a system message on some):

- quote:     "Quote Genesis 1:3."                 -> the verse
- finish:    "Finish the verse: And God said, ..." -> the rest of the verse
- book:      "Which book is this verse from? ..."  -> "Genesis."
- next:      "What verse follows: ..."          -> the next verse
- chapters:  "How many chapters does Ruth have?"  -> "Ruth has 4 chapters."
- opening:   "Which chapter begins: ...?"          -> "Genesis 1."
- follow-up: a quote, then "And the next verse?"  -> the next verse
"""

from __future__ import annotations

import json
import pathlib
import random

HERE = pathlib.Path(__file__).resolve().parent
SEED = 0
COUNTS = {"quote": 90, "finish": 90, "book": 60, "next": 50, "chapters": 16, "opening": 44, "follow_up": 50}
MAX_VERSE_CHARS = 100  # short answers: nearly every conversation fits 256 bytes
SYSTEM = "Answer from the King James Bible."
SYSTEM_EVERY = 3  # one conversation in three starts with the system message


def read_chapters(path: pathlib.Path) -> list[tuple[str, int, list[str]]]:
    """``(book, chapter, verses)`` per blank-line block of ``kjv.txt``."""
    chapters = []
    for block in path.read_text(encoding="utf-8").strip().split("\n\n"):
        title, *verses = block.strip().split("\n")
        book, number = title.rsplit(" ", 1)
        chapters.append((book, int(number), verses))
    return chapters


def conversations(chapters, rng: random.Random) -> list[list[dict]]:
    verses = [(book, c, v + 1, text, chapter_verses) for book, c, chapter_verses in chapters
              for v, text in enumerate(chapter_verses)]
    short = [x for x in verses if len(x[3]) <= MAX_VERSE_CHARS]
    followed = [x for x in short if x[2] < len(x[4]) and len(x[4][x[2]]) <= MAX_VERSE_CHARS]
    books = list(dict.fromkeys(book for book, _, _ in chapters))

    def user(text):
        return {"role": "user", "content": text}

    def assistant(text):
        return {"role": "assistant", "content": text}

    out = []
    for book, c, v, text, _ in rng.sample(short, COUNTS["quote"]):
        out.append([user(f"Quote {book} {c}:{v}."), assistant(text)])
    for book, c, v, text, _ in rng.sample([x for x in short if len(x[3].split()) >= 8], COUNTS["finish"]):
        words = text.split()
        cut = len(words) // 2
        out.append([user(f"Finish the verse: {' '.join(words[:cut])}"), assistant(" ".join(words[cut:]))])
    for book, c, v, text, _ in rng.sample(short, COUNTS["book"]):
        out.append([user(f"Which book is this verse from? {text}"), assistant(f"{book}.")])
    for book, c, v, text, chapter_verses in rng.sample(followed, COUNTS["next"]):
        out.append([user(f"What verse follows: {text}"), assistant(chapter_verses[v])])
    per_book = {b: sum(1 for book, _, _ in chapters if book == b) for b in books}
    phrasings = ("How many chapters does {} have?", "How many chapters are in {}?")
    for k in range(COUNTS["chapters"]):
        b = books[k % len(books)]
        out.append([user(phrasings[k // len(books) % 2].format(b)), assistant(f"{b} has {per_book[b]} chapters.")])
    openings = [(book, c, vs[0]) for book, c, vs in chapters if len(vs[0]) <= MAX_VERSE_CHARS]
    for book, c, first in rng.sample(openings, COUNTS["opening"]):
        out.append([user(f"Which chapter begins: {first}"), assistant(f"{book} {c}.")])
    for book, c, v, text, chapter_verses in rng.sample(followed, COUNTS["follow_up"]):
        out.append([user(f"Quote {book} {c}:{v}."), assistant(text), user("And the next verse?"),
                    assistant(chapter_verses[v])])
    rng.shuffle(out)
    return [([{"role": "system", "content": SYSTEM}] if i % SYSTEM_EVERY == 0 else []) + conv
            for i, conv in enumerate(out)]


def main() -> None:
    convs = conversations(read_chapters(HERE / "kjv.txt"), random.Random(SEED))
    lines = [json.dumps({"messages": conv}, ensure_ascii=False) for conv in convs]
    (HERE / "chat.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} conversations to {HERE / 'chat.jsonl'}")


if __name__ == "__main__":
    main()
