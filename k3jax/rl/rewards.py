"""Reward functions for RL with verifiable rewards, and the scoring of a batch of completions.

Convention (TRL's ``reward_funcs``, tunix's ``RewardFn``): a reward function is::

    fn(prompts: list[str], completions: list[str], **fields) -> list[float]     # one reward per completion

``completions[i]`` is the decoded text of the model's reply to ``prompts[i]`` (for a chat prompt: the
assistant reply's text); ``fields`` maps each other field name of the prompt records (``answer``, ...;
``k3jax.rl.prompts.PromptRecord.fields``) to a list with one entry per completion (``None`` where a record
lacks the field). A function is called once per batch, so it may batch its own work.

Built-ins (:func:`load_reward` by name; ``answer_field``, default ``"answer"``, names the record field
holding the reference answer; a list there is a set of accepted answers, any of which matches):

- ``exact_match``: the completion's answer (:func:`extract_answer` with ``answer_pattern``: the *last*
  match in the text, its first group when the pattern has groups; default :data:`DEFAULT_ANSWER_PATTERN`,
  the last number) compared with the record's answer after :func:`normalize_answer` (whitespace
  collapsed, case folded, trailing periods dropped). The record's answer matches in two forms: the whole
  field, normalised, and its own extracted answer (so a GSM8K-style solution ``"... #### 72"`` or a
  sentence ``"Genesis has 50 chapters."`` is compared by its last number). Text the pattern does not match
  counts whole, so ``"Leviticus."`` matches ``"leviticus"`` under the default number pattern. Two
  numbers compare by value (``"50.0"`` = ``"50"``, ``"1,000"`` = ``"1000"``). Caveat of matching the
  answer's extracted form: a textual answer holding a number (``"Leviticus 15."``) is matched by any reply
  ending in that number; give such data a specific ``answer_pattern``. 1.0 on a match, else 0.0.
- ``format``: 1.0 when the stripped completion matches ``format_pattern`` as a whole (``re.fullmatch``,
  ``re.DOTALL``), else 0.0. The pattern is required (there is no format every tokenizer's replies share).
- ``math``: ``math_verify.verify(parse(answer), parse(completion))`` (Hugging Face's Math-Verify: LaTeX,
  ``\\boxed{}``, plain numbers, sets, intervals; ``\\frac{1}{2}`` = ``0.5``). A completion math-verify
  cannot parse (or that raises inside it, or times out) scores 0.0: that is the checker's verdict. A
  reference without math delimiters (``$``, ``\\(``, ``\\[``, ``\\boxed``) is read as a bare LaTeX
  expression (``3\\sqrt{2}``, ``x^2``, ``(1,2)``; it is wrapped in ``$...$``, else read as is); one it
  cannot parse into an expression is an error naming the record (the data is wrong, not the model).
  Needs ``pip install math-verify`` (:data:`MATH_VERIFY_REQUIREMENT`). Outside the main thread
  math-verify's signal-based timeouts are off (they cannot work there).

Any other name is ``package.module:function`` (an attribute path after the colon, e.g.
``mypkg.rewards:Scorer.score``), imported and used as is.

:func:`score_rewards` runs the functions over a batch and checks what they return: a function that
raises, returns the wrong number of rewards or a reward that is not a finite number (``bool`` counts as
0 / 1; ``None``, strings, NaN and infinities do not) raises :class:`RewardError` naming the function and
the record (``wheres[i]``).
"""

from __future__ import annotations

import decimal
import difflib
import functools
import math
import numbers
import re
import threading
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from k3jax.config.callables import import_callable
from k3jax.config.fields import ConfigError

RewardFn = Callable[..., Sequence[float]]

BUILTINS = ("exact_match", "format", "math")
FIELD = "train.rl.rewards"  # the config field errors name
MATH_VERIFY_REQUIREMENT = "math-verify==0.9.0"

# The last number of a text: an optional minus (not one joining two words or numbers: "10-12" -> 10, 12),
# digits with optional thousands commas ("1,000"), an optional decimal part. A trailing period is not
# part of it ("42." -> 42).
DEFAULT_ANSWER_PATTERN = r"(?:(?<![\w.])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_MATH_DELIMITERS = re.compile(r"\$|\\\(|\\\[|\\boxed")
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")


class RewardError(RuntimeError):
    """A reward function failed on a batch: it raised, returned the wrong number of rewards, or a reward
    that is not a finite number. ``function``: its name; ``where``: the record (``None`` when no single
    record is to blame)."""

    def __init__(self, message: str, *, function: str, where: str | None = None):
        super().__init__(message)
        self.function, self.where = function, where


# --- answers ------------------------------------------------------------------------------------------


def normalize_answer(text: str) -> str:
    """``text`` with whitespace collapsed to single spaces and stripped, case folded, and trailing periods
    removed: ``"  Genesis   has 50 chapters. "`` -> ``"genesis has 50 chapters"``."""
    return " ".join(text.split()).casefold().rstrip(".").rstrip()


def extract_answer(text: str, pattern: str | re.Pattern = DEFAULT_ANSWER_PATTERN) -> str:
    """The answer in ``text``: the last match of ``pattern`` (its first group when the pattern has one and
    the group took part in the match, else the whole match); the whole ``text`` when nothing matches."""
    pattern = re.compile(pattern) if isinstance(pattern, str) else pattern
    last = None
    for last in pattern.finditer(text):
        pass
    if last is None:
        return text
    if pattern.groups and last.group(1) is not None:
        return last.group(1)
    return last.group(0)


def _number(text: str) -> decimal.Decimal | None:
    return decimal.Decimal(text.replace(",", "")) if _NUMBER.fullmatch(text) else None


def _same(a: str, b: str) -> bool:
    """Two normalised answers are equal as text, or as numbers."""
    if a == b:
        return True
    x, y = _number(a), _number(b)
    return x is not None and y is not None and x == y


def _references(value: Any, fn: str, field: str) -> list[str]:
    """A record's reference answer(s) as strings (a number is written out; a list is alternatives)."""
    values = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for v in values:
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, numbers.Real) and not isinstance(v, bool):
            out.append(str(v))
        else:
            raise ValueError(f"{fn}: the record's {field!r} is {type(v).__name__} ({v!r:.60}), not a string or "
                             "number (or a list of them)")
    if not any(v.strip() for v in out):
        raise ValueError(f"{fn}: the record's {field!r} is empty")
    return out


def _column(fields: Mapping[str, list], field: str, fn: str, n: int) -> list:
    if field not in fields:
        raise ValueError(f"{fn}: the records have no field {field!r} (the answer field); their fields: "
                         f"{sorted(fields)}")
    column = fields[field]
    if len(column) != n:
        raise ValueError(f"{fn}: field {field!r} has {len(column)} entries for {n} completions")
    return column


def _check_text(completion: Any, fn: str) -> str:
    if not isinstance(completion, str):
        raise ValueError(f"{fn}: a completion is {type(completion).__name__}, not a string")
    return completion


def exact_match_reward(answer_pattern: str | None = None, answer_field: str = "answer") -> RewardFn:
    """The ``exact_match`` reward (module docstring): ``fn(prompts, completions, **fields) -> list[float]``
    of 1.0 / 0.0."""
    pattern = re.compile(DEFAULT_ANSWER_PATTERN if answer_pattern is None else answer_pattern)

    def reward(prompts: list[str], completions: list[str], **fields) -> list[float]:
        refs = _column(fields, answer_field, "exact_match", len(completions))
        rewards = []
        for completion, ref in zip(completions, refs):
            got = normalize_answer(extract_answer(_check_text(completion, "exact_match"), pattern))
            accepted = set()
            for r in _references(ref, "exact_match", answer_field):
                accepted.update({normalize_answer(r), normalize_answer(extract_answer(r, pattern))})
            accepted.discard("")
            rewards.append(float(bool(got) and any(_same(got, a) for a in accepted)))
        return rewards

    reward.__name__ = reward.__qualname__ = "exact_match"
    return reward


def format_reward(format_pattern: str) -> RewardFn:
    """The ``format`` reward: 1.0 where ``re.fullmatch(format_pattern, completion.strip(), re.DOTALL)``."""
    pattern = re.compile(format_pattern, re.DOTALL)

    def reward(prompts: list[str], completions: list[str], **fields) -> list[float]:
        return [float(pattern.fullmatch(_check_text(c, "format").strip()) is not None) for c in completions]

    reward.__name__ = reward.__qualname__ = "format"
    return reward


def _math_verify():
    try:
        import math_verify
    except ImportError as e:
        raise ImportError(f"{FIELD}: the 'math' reward needs the math-verify package: "
                          f"pip install '{MATH_VERIFY_REQUIREMENT}'") from e
    return math_verify


def math_reward(answer_field: str = "answer") -> RewardFn:
    """The ``math`` reward (module docstring): math-verify's verdict on each completion against the
    record's answer, 1.0 / 0.0."""
    mv = _math_verify()

    def timeout() -> int | None:
        # math-verify times out with SIGALRM, which only the main thread may install
        return 5 if threading.current_thread() is threading.main_thread() else None

    @functools.lru_cache(maxsize=4096)  # the same reference is parsed for every completion of its group
    def gold(ref: str) -> tuple:
        # A bare expression parses right only inside math delimiters: bare, "2x+1" reads as 2 and "x^2" not at
        # all. Either way the parse must hold an expression, not only math-verify's fallback string.
        texts = (ref,) if _MATH_DELIMITERS.search(ref) else (f"${ref}$", ref)
        for text in texts:
            parsed = mv.parse(text, parsing_timeout=timeout())
            if any(not isinstance(p, str) for p in parsed):
                return tuple(parsed)
        raise ValueError(f"math: math-verify cannot parse the record's {answer_field!r} {ref!r:.80} as a "
                         "mathematical answer")

    def reward(prompts: list[str], completions: list[str], **fields) -> list[float]:
        refs = _column(fields, answer_field, "math", len(completions))
        rewards = []
        for completion, ref in zip(completions, refs):
            golds = [gold(r) for r in _references(ref, "math", answer_field)]
            completion = _check_text(completion, "math")
            try:
                pred = mv.parse(completion, parsing_timeout=timeout())
                ok = bool(pred) and any(mv.verify(list(g), pred, timeout_seconds=timeout()) for g in golds)
            except Exception:  # the checker's failure on this completion is its verdict: not verified
                ok = False
            rewards.append(float(ok))
        return rewards

    reward.__name__ = reward.__qualname__ = "math"
    return reward


# --- loading ------------------------------------------------------------------------------------------


def _compile(pattern: str, name: str, option: str, flags: int = 0) -> None:
    try:
        re.compile(pattern, flags)
    except re.error as e:
        raise ConfigError(f"{FIELD}: {name!r}: {option} (train.rl.{option}) {pattern!r} is not a valid regular "
                          f"expression ({e})") from None


def load_reward(name: str, *, answer_pattern: str | None = None, format_pattern: str | None = None,
                answer_field: str = "answer") -> RewardFn:
    """The reward function ``name``: a built-in (:data:`BUILTINS`, configured by the keyword options) or
    ``package.module:function`` (imported; the options do not apply). An unknown name, a missing module or
    attribute, something not callable, or an invalid option raises ``ConfigError`` naming
    ``train.rl.rewards`` and ``name`` (with the closest built-in names for a typo)."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{FIELD}: a reward name must be a non-empty string, got {name!r}")
    name = name.strip()
    if not isinstance(answer_field, str) or not answer_field:
        raise ConfigError(f"{FIELD}: {name!r}: answer_field must be a non-empty string, got {answer_field!r}")
    if name == "exact_match":
        if answer_pattern is not None:
            _compile(answer_pattern, name, "answer_pattern")
        return exact_match_reward(answer_pattern, answer_field)
    if name == "format":
        if format_pattern is None:
            raise ConfigError(f"{FIELD}: 'format' needs a format_pattern (train.rl.format_pattern: a regular "
                              "expression the whole reply must match)")
        _compile(format_pattern, name, "format_pattern", re.DOTALL)
        return format_reward(format_pattern)
    if name == "math":
        return math_reward(answer_field)
    if ":" in name:
        return import_callable(name, FIELD)
    close = difflib.get_close_matches(name, BUILTINS, n=2, cutoff=0.6)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    raise ConfigError(f"{FIELD}: unknown reward {name!r}{hint}; a built-in ({', '.join(BUILTINS)}) or "
                      "'package.module:function'")


# --- scoring ------------------------------------------------------------------------------------------


def _as_list(value: Any) -> list | None:
    """A reward function's return value as a list, or None when it is not a sequence."""
    if isinstance(value, np.ndarray):
        return value.tolist() if value.ndim == 1 else None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return None
    return list(value)


def _reward_value(value: Any) -> float | None:
    """``value`` as a float when it is a finite number (bool included), else None."""
    if isinstance(value, (bool, np.bool_)):
        return float(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    return None


def _batch_fields(records: Sequence[Mapping[str, Any]]) -> dict[str, list]:
    names: dict[str, None] = {}
    for record in records:
        names.update(dict.fromkeys(record))
    for clash in ("prompts", "completions"):
        if clash in names:
            raise ValueError(f"a prompt record field is named {clash!r}, which reward functions take as their "
                             "own argument; rename the field")
    return {k: [record.get(k) for record in records] for k in names}


def _records_text(wheres: Sequence[str]) -> str:
    return wheres[0] if len(wheres) == 1 else f"the batch of {len(wheres)} records {wheres[0]} ... {wheres[-1]}"


def _score_one(name: str, fn: RewardFn, prompts, completions, fields, wheres) -> np.ndarray:
    n = len(completions)

    def call(idx):
        return fn([prompts[i] for i in idx], [completions[i] for i in idx],
                  **{k: [v[i] for i in idx] for k, v in fields.items()})

    def locate(problem: str, cause: BaseException | None) -> None:
        """Re-score one completion at a time and raise naming the first record that fails alone (or, when
        none does, the batch). Always raises."""
        for i in range(n):
            try:
                single = _as_list(call([i]))
            except Exception as e:
                raise RewardError(f"reward {name!r} raised on {wheres[i]}: {type(e).__name__}: {e}",
                                  function=name, where=wheres[i]) from e
            if single is None or len(single) != 1:
                got = "a non-sequence" if single is None else f"{len(single)} rewards"
                raise RewardError(f"reward {name!r} returned {got} for the 1 completion of {wheres[i]}",
                                  function=name, where=wheres[i]) from cause
        raise RewardError(f"reward {name!r} {problem} on {_records_text(wheres)} (but not on any of them "
                          "alone)", function=name) from cause

    try:
        result = call(range(n))
    except Exception as e:
        locate(f"raised {type(e).__name__}: {e}", e)
    values = _as_list(result)
    if values is None:
        raise RewardError(f"reward {name!r} returned {type(result).__name__} ({result!r:.60}) for "
                          f"{_records_text(wheres)}, not a list of {n} rewards", function=name)
    if len(values) != n:
        locate(f"returned {len(values)} rewards for {n} completions", None)
    out = np.empty(n, np.float64)
    for i, v in enumerate(values):
        x = _reward_value(v)
        if x is None:
            raise RewardError(f"reward {name!r} returned {v!r:.60} ({type(v).__name__}) for {wheres[i]}: not a "
                              "finite number", function=name, where=wheres[i])
        out[i] = x
    return out


def score_rewards(fns: Mapping[str, RewardFn], weights: Mapping[str, float] | None, prompts: Sequence[str],
                  completions: Sequence[str], records: Sequence[Mapping[str, Any]],
                  wheres: Sequence[str]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Score ``N`` completions with every reward function.

    fns: ``{name: fn}`` (names appear in errors and metrics); weights: ``{name: weight}``, a missing name
    (or ``None`` for all) weighing 1.0; prompts, completions: ``N`` strings; records: ``N`` dicts of the
    records' other fields (``PromptRecord.fields``), passed to each fn as ``field=[N values]``; wheres:
    ``N`` record locations (``PromptRecord.where``) for errors.

    Each fn is called once over the whole batch. Returns ``(total float64[N], {name: float64[N]})``, total
    the weighted sum. A fn that raises, returns other than ``N`` rewards, or a reward that is not a finite
    number raises :class:`RewardError` naming the fn and the record; for a raise or a wrong count the batch
    is re-scored one completion at a time to find the first record that fails."""
    n = len(completions)
    for what, seq in (("prompts", prompts), ("records", records), ("wheres", wheres)):
        if len(seq) != n:
            raise ValueError(f"score_rewards: {len(seq)} {what} for {n} completions")
    if not fns:
        raise ValueError("score_rewards: no reward functions")
    weights = dict(weights or {})
    unknown = sorted(set(weights) - set(fns))
    if unknown:
        raise ValueError(f"score_rewards: weights for rewards that are not scored: {unknown}; scored: {sorted(fns)}")
    for name, w in weights.items():
        if _reward_value(w) is None:
            raise ValueError(f"score_rewards: the weight of {name!r} is {w!r}, not a finite number")
    prompts, completions, wheres = list(prompts), list(completions), [str(w) for w in wheres]
    fields = _batch_fields(records)
    per_fn = {name: (_score_one(name, fn, prompts, completions, fields, wheres) if n else np.zeros(0, np.float64))
              for name, fn in fns.items()}
    total = np.zeros(n, np.float64)
    for name, values in per_fn.items():
        total += float(weights.get(name, 1.0)) * values
    return total, per_fn


__all__ = ["BUILTINS", "DEFAULT_ANSWER_PATTERN", "MATH_VERIFY_REQUIREMENT", "RewardError", "RewardFn",
           "exact_match_reward", "extract_answer", "format_reward", "load_reward", "math_reward",
           "normalize_answer", "score_rewards"]
