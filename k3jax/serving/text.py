"""Text side of a request: chat prompts (``k3jax.data.chat.chat_prompt``: the tokenizer's chat format,
or the plain transcript that chat fine-tuning trains on), and generated ids back to text with OpenAI
``stop`` strings."""

from __future__ import annotations

from typing import Sequence

from k3jax.data.chat import chat_prompt  # the one rendering of chat prompts, shared with chat training data


class TextStream:
    """Incremental detokenisation with stop strings.

    ``add(id)`` returns the text that is final so far; text is held back while it ends inside a
    multi-byte character (decodes to U+FFFD) or could be the start of a stop string. When a stop
    string appears, the text before it is the whole output and ``stopped`` becomes true.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.emitted = ""  # text handed out so far
        self.stopped = False

    def add(self, token: int) -> str:
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids)
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            return self._advance(text[:cut])
        end = len(text)
        while end > len(self.emitted) and text[end - 1] == "\ufffd":
            end -= 1
        return self._advance(text[:end - self._held(text[:end])])

    def finish(self) -> str:
        """The rest of the text at the end of generation (nothing is held back any more)."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids)
        cut = self._stop_at(text)
        return self._advance(text if cut is None else text[:cut])

    def _advance(self, text: str) -> str:
        if not text.startswith(self.emitted) or len(text) <= len(self.emitted):
            return ""
        delta = text[len(self.emitted):]
        self.emitted = text
        return delta

    def _stop_at(self, text: str) -> int | None:
        """Index of the earliest stop string in ``text``. Emitted text never ends with the start of
        a stop string (that part is held back), so a match ends after it: the search starts just
        far enough before its end."""
        start = max(0, len(self.emitted) - max((len(s) for s in self.stop), default=0) + 1)
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _held(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best


__all__ = ["TextStream", "chat_prompt"]
