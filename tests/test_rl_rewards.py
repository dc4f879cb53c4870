"""k3jax.rl.rewards (built-in rewards, module:function loading, score_rewards' errors) and k3jax.rl.prompts
(prompt records from JSONL / parquet / the bundled chat set, the held-out split, bad records, token ids,
the resumable batch iterator). Fast: no model."""

import json
import sys
import threading

import numpy as np
import pytest

from k3jax.config.fields import ConfigError
from k3jax.data.chat import chat_prompt, open_conversations
from k3jax.data.pipeline import split_indices
from k3jax.data.sources import BadRecordError
from k3jax.rl.prompts import (PromptIterator, epoch_permutation, open_prompts, parse_prompt, prompt_ids,
                              prompt_text)
from k3jax.rl.rewards import (RewardError, extract_answer, load_reward, normalize_answer, score_rewards)
from k3jax.tokenizer import load_tokenizer


def _score(fn, completions, answers, field="answer"):
    return fn(["q"] * len(completions), completions, **{field: answers})


# --- answers ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,expected", [
    ("The answer is 42.", "42"),  # the trailing period is not part of the number
    ("first 3, then 7", "7"),  # the last number
    ("x = -5", "-5"),
    ("pages 10-12", "12"),  # a hyphen between numbers is no minus sign
    ("it costs $1,234.50 in total", "1,234.50"),
    ("1,2,3", "3"),  # a list, not a thousands-separated number
    ("pi is about 3.14159", "3.14159"),
    ("no number here", "no number here"),  # nothing matches: the whole text
    ("", ""),
])
def test_extract_answer_default(text, expected):
    assert extract_answer(text) == expected


def test_extract_answer_groups():
    assert extract_answer("Answer: 12\nAnswer: Leviticus", r"Answer:\s*(\w+)") == "Leviticus"  # last, group 1
    assert extract_answer("#### 72", r"####\s*(-?\d+)|(\w+)") == "72"
    assert extract_answer("zzz", r"(\d+)?z") == "z"  # group 1 did not take part: the whole match


def test_normalize_answer():
    assert normalize_answer("  Genesis   has\n50 Chapters.. ") == "genesis has 50 chapters"
    assert normalize_answer("STRASSE") == normalize_answer("straße")  # casefold, not lower


def test_exact_match():
    fn = load_reward("exact_match")
    completions = ["So the result is 42.", "It is 41", "The answer: 42.0", "1,000 apples", "Genesis has 50 chapters.",
                   "leviticus", "Leviticus.", "-3", "nothing"]
    answers = ["42", "42", "42", "1000", "Genesis has 50 chapters.", "Leviticus.", "Numbers.", -3, "7"]
    assert _score(fn, completions, answers) == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    # the answer field's extracted form: a GSM8K-style solution and a sentence compare by their last number
    assert _score(fn, ["72", "50", "51"], ["She sold 48 + 24 = 72 clips.\n#### 72", "Genesis has 50 chapters.",
                                             "Genesis has 50 chapters."]) == [1.0, 1.0, 0.0]
    assert _score(fn, ["paris", "Rome"], [["Paris", "Paris, France"], ["Paris"]]) == [1.0, 0.0]  # alternatives
    custom = load_reward("exact_match", answer_pattern=r"<answer>(.*?)</answer>", answer_field="solution")
    assert _score(custom, ["<think>2+2</think><answer> Four </answer>", "<answer>five</answer>"],
                  ["four", "four"], field="solution") == [1.0, 0.0]


def test_format():
    fn = load_reward("format", format_pattern=r"<think>.*?</think>\s*\S.*")
    assert _score(fn, ["<think>a\nb</think> 42", "  <think></think>x\n", "42", "<think>a</think>"], [None] * 4) \
        == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ConfigError, match="train.rl.rewards.*'format' needs a format_pattern"):
        load_reward("format")
    with pytest.raises(ConfigError, match="train.rl.rewards.*format_pattern.*not a valid regular expression"):
        load_reward("format", format_pattern="(")
    with pytest.raises(ConfigError, match="answer_pattern.*not a valid regular expression"):
        load_reward("exact_match", answer_pattern="[")


def test_math():
    fn = load_reward("math")
    completions = ["0.5", "The answer is $\\frac{1}{2}$.", "\\boxed{0.5}", "0.25", "so $x^{2}$", "\\frac{",
                   "no answer at all", "\\boxed{3}"]
    answers = ["\\frac{1}{2}", "0.5", "$\\frac{1}{2}$", "\\frac{1}{2}", "x^2", "2", "2", 3]
    assert _score(fn, completions, answers) == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    # bare LaTeX references are read whole ("2x+1" alone would parse as 2)
    assert _score(fn, ["$2x+1$", "2", "$3\\sqrt{2}$", "3", "the interval $(1,2)$"],
                  ["2x+1", "2x+1", "3\\sqrt{2}", "3\\sqrt{2}", "(1,2)"]) == [1.0, 0.0, 1.0, 0.0, 1.0]
    # outside the main thread (math-verify's SIGALRM timeouts cannot be installed there)
    out = []
    thread = threading.Thread(target=lambda: out.append(_score(fn, ["\\frac{2}{4}", "1"], ["0.5", "0.5"])))
    thread.start()
    thread.join()
    assert out == [[1.0, 0.0]]


def test_math_unparseable_reference_names_the_record():
    with pytest.raises(RewardError, match=r"reward 'math' raised on data.jsonl:2: ValueError: .*cannot parse"):
        score_rewards({"math": load_reward("math")}, None, ["q"] * 2, ["1", "1"],
                      [{"answer": "1"}, {"answer": "\\frac{"}], ["data.jsonl:1", "data.jsonl:2"])


def test_math_verify_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify raises ImportError
    with pytest.raises(ImportError, match="pip install 'math-verify"):
        load_reward("math")


# --- loading ------------------------------------------------------------------------------------------


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    name = f"my_rewards_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(
        "def length_reward(prompts, completions, **fields):\n"
        "    return [float(len(c)) for c in completions]\n"
        "class Scorer:\n"
        "    @staticmethod\n"
        "    def score(prompts, completions, **fields):\n"
        "        return [1.0] * len(completions)\n"
        "NOT_A_FUNCTION = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_load_module_function(reward_module):
    fn = load_reward(f"{reward_module}:length_reward")
    assert fn(["p", "p"], ["ab", "abcd"]) == [2.0, 4.0]
    assert load_reward(f"{reward_module}:Scorer.score")(["p"], ["x"]) == [1.0]
    with pytest.raises(ConfigError, match=rf"train.rl.rewards: '{reward_module}:length_rewrd'.*did you mean "
                                          r"'length_reward'"):
        load_reward(f"{reward_module}:length_rewrd")
    with pytest.raises(ConfigError, match="train.rl.rewards.*NOT_A_FUNCTION' is a int, not a function"):
        load_reward(f"{reward_module}:NOT_A_FUNCTION")
    with pytest.raises(ConfigError, match=r"train.rl.rewards: 'no_such_pkg_xyz.rewards:f': no module named "
                                          r"'no_such_pkg_xyz'"):
        load_reward("no_such_pkg_xyz.rewards:f")
    with pytest.raises(ConfigError, match="expected 'package.module:function'"):
        load_reward(f"{reward_module}:")


def test_load_import_error_of_the_module_itself(tmp_path, monkeypatch):
    (tmp_path / "broken_reward_mod.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="importing 'broken_reward_mod' failed.*no_such_dependency_xyz"):
        load_reward("broken_reward_mod:f")


@pytest.mark.parametrize("name,hint", [("exact_mach", "did you mean 'exact_match'"), ("fromat", "did you mean "
                                       "'format'"), ("maths", "did you mean 'math'"), ("bleu", "a built-in")])
def test_unknown_reward_names(name, hint):
    with pytest.raises(ConfigError, match=rf"train.rl.rewards: unknown reward '{name}'.*{hint}"):
        load_reward(name)


# --- score_rewards ------------------------------------------------------------------------------------

WHERES = ["chat.jsonl:1", "chat.jsonl:2", "chat.jsonl:3", "chat.jsonl:4"]
RECORDS = [{"answer": "1", "kind": "a"}, {"answer": "2", "kind": "b"}, {"answer": "3"}, {"answer": "4", "kind": "d"}]


def test_score_rewards_totals_and_fields():
    seen = {}

    def spy(prompts, completions, **fields):
        seen.update(fields, prompts=prompts)
        return [True, False, 1, np.float32(0.5)]  # bool and numpy numbers are numbers

    fns = {"exact": load_reward("exact_match"), "spy": spy}
    total, per_fn = score_rewards(fns, {"exact": 2.0}, ["p1", "p2", "p3", "p4"], ["1", "x 2", "5", "4."], RECORDS,
                                  WHERES)
    np.testing.assert_array_equal(per_fn["exact"], [1, 1, 0, 1])
    np.testing.assert_array_equal(per_fn["spy"], [1, 0, 1, 0.5])
    np.testing.assert_array_equal(total, [3, 2, 1, 2.5])
    assert total.dtype == np.float64 and total.shape == (4,)
    assert seen == {"answer": ["1", "2", "3", "4"], "kind": ["a", "b", None, "d"], "prompts": ["p1", "p2", "p3", "p4"]}
    with pytest.raises(ValueError, match="weights for rewards that are not scored"):
        score_rewards(fns, {"exactt": 1.0}, ["p"] * 4, ["1"] * 4, RECORDS, WHERES)


def test_reward_error_raise_names_the_record():
    calls = []

    def picky(prompts, completions, **fields):
        calls.append(len(completions))
        if any(c == "boom" for c in completions):
            raise KeyError("no luck")
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match=r"reward 'picky' raised on chat.jsonl:3: KeyError") as e:
        score_rewards({"picky": picky}, None, ["p"] * 4, ["a", "b", "boom", "d"], RECORDS, WHERES)
    assert (e.value.function, e.value.where) == ("picky", "chat.jsonl:3")
    assert calls == [4, 1, 1, 1]  # the batch, then one at a time up to the culprit


def test_reward_error_missing_field_names_function_and_record():
    with pytest.raises(RewardError, match=r"reward 'exact_match' raised on chat.jsonl:1: .*no field 'answer'"):
        score_rewards({"exact_match": load_reward("exact_match")}, None, ["p"] * 2, ["1", "2"], [{}, {}], WHERES[:2])


@pytest.mark.parametrize("bad", [None, "1.0", float("nan"), float("inf"), [1.0], {"r": 1}])
def test_reward_error_non_number(bad):
    def fn(prompts, completions, **fields):
        return [1.0, bad, 0.0, 1.0]

    with pytest.raises(RewardError, match=r"reward 'fn' returned .* for chat.jsonl:2: not a finite number") as e:
        score_rewards({"fn": fn}, None, ["p"] * 4, ["a"] * 4, RECORDS, WHERES)
    assert e.value.where == "chat.jsonl:2"


def test_reward_error_wrong_length():
    def short(prompts, completions, **fields):  # drops the completions it dislikes
        return [1.0 for c in completions if c != "skip"]

    with pytest.raises(RewardError, match=r"reward 'short' returned 0 rewards for the 1 completion of chat.jsonl:4"):
        score_rewards({"short": short}, None, ["p"] * 4, ["a", "b", "c", "skip"], RECORDS, WHERES)

    def always_three(prompts, completions, **fields):
        return [1.0, 1.0, 1.0] if len(completions) > 1 else [1.0]

    with pytest.raises(RewardError, match=r"returned 3 rewards for 4 completions on the batch of 4 records "
                                          r"chat.jsonl:1 \.\.\. chat.jsonl:4") as e:
        score_rewards({"always_three": always_three}, None, ["p"] * 4, ["a"] * 4, RECORDS, WHERES)
    assert e.value.where is None

    with pytest.raises(RewardError, match="returned float .* not a list of 4 rewards"):
        score_rewards({"scalar": lambda p, c, **f: 1.0}, None, ["p"] * 4, ["a"] * 4, RECORDS, WHERES)


# --- prompts ------------------------------------------------------------------------------------------


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}], "answer": "4"}
TEXT = {"prompt": "Q: 3+4=? A:", "answer": 7, "level": "easy"}


def test_prompts_from_jsonl(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [CHAT, TEXT] * 5)
    prompts = open_prompts(path, eval_fraction=0)
    assert len(prompts) == 10
    chat, text = prompts[0], prompts[1]
    assert chat.is_chat and chat.text is None and chat.tools is None and chat.fields == {"answer": "4"}
    assert [m["role"] for m in chat.messages] == ["system", "user"]
    assert not text.is_chat and text.text == "Q: 3+4=? A:" and text.fields == {"answer": 7, "level": "easy"}
    assert "p.jsonl: record 1 (line 2)" in text.where
    tok = load_tokenizer("byte")
    assert prompt_ids(tok, chat) == chat_prompt(tok, CHAT["messages"])
    assert tok.decode(prompt_ids(tok, chat)).endswith("assistant:")  # ends with the generation prompt
    assert prompt_ids(tok, text) == tok.encode("Q: 3+4=? A:")
    assert prompt_text(tok, text) == "Q: 3+4=? A:" and prompt_text(tok, chat).endswith("user: 2+2?\x04\nassistant:")


def test_prompts_from_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.Table.from_pylist([
        {"messages": [{"role": "user", "content": "1+1?"}], "prompt": None, "answer": "2"},
        {"messages": None, "prompt": "Say hi:", "answer": "hi"},
    ])
    pq.write_table(table, tmp_path / "p.parquet")
    prompts = open_prompts(str(tmp_path / "p.parquet"), eval_fraction=0)
    assert prompts[0].messages == ({"role": "user", "content": "1+1?"},) and prompts[0].fields == {"answer": "2"}
    assert prompts[1].text == "Say hi:" and prompts[1].fields == {"answer": "hi"}
    assert "p.parquet: record 1" in prompts[1].where


def test_bundled_prompts():
    train, held_out = open_prompts("bundled"), open_prompts("bundled", split="eval")
    genesis = [train[i] for i in range(len(train)) if train[i].messages[-1]["content"] ==
               "How many chapters does Genesis have?"]
    assert len(genesis) == 1 and genesis[0].fields["answer"] == "Genesis has 50 chapters."
    assert genesis[0].messages[-1]["role"] == "user" and "chat.jsonl: record" in genesis[0].where
    for ps in (train, held_out):
        assert all(ps[i].messages[-1]["role"] != "assistant" for i in range(len(ps)))
    # every bundled conversation ends with an assistant turn: the split is exactly the chat fine-tune's
    n = len(open_conversations("bundled"))
    assert len(train) + len(held_out) == n
    np.testing.assert_array_equal(held_out.indices, split_indices(n, 0.1, "eval"))
    np.testing.assert_array_equal(train.indices, split_indices(n, 0.1, "train"))
    # the reward of the reference reply itself
    rec = held_out[0]
    total, _ = score_rewards({"exact_match": load_reward("exact_match")}, None, ["p"], [rec.fields["answer"]],
                             [rec.fields], [rec.where])
    assert total.tolist() == [1.0]


def test_held_out_split_disjoint_and_stable(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"question {i}", "answer": str(i)} for i in range(200)])
    train, held = open_prompts(path, eval_fraction=0.2), open_prompts(path, split="eval", eval_fraction=0.2)
    train_q = {train[i].text for i in range(len(train))}
    held_q = {held[i].text for i in range(len(held))}
    assert not train_q & held_q and len(train_q | held_q) == 200
    assert 20 <= len(held_q) <= 60
    again = open_prompts(path, split="eval", eval_fraction=0.2)
    assert [again[i].text for i in range(len(again))] == [held[i].text for i in range(len(held))]
    np.testing.assert_array_equal(held.indices, split_indices(200, 0.2, "eval"))  # the chat fine-tune's rule
    with pytest.raises(ValueError, match="eval split .* is empty"):
        open_prompts(path, split="eval", eval_fraction=0)


@pytest.mark.parametrize("record,message", [
    ({"answer": "1"}, "neither 'prompt' nor 'messages'"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "both 'prompt' and 'messages'"),
    ({"prompt": 3}, "'prompt' is int, not a string"),
    ({"prompt": "  "}, "'prompt' is empty"),
    ({"prompt": "a", "tools": [{"type": "function"}]}, "'tools' needs a chat prompt"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "unknown role 'robot'"),
    ({"messages": []}, "must be a non-empty list"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": "x"}, "tools: must be a list"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
     "last message is an assistant turn"),
    ([1, 2], "expected a JSON object"),
])
def test_bad_records(tmp_path, record, message):
    path = _write_jsonl(tmp_path / "bad.jsonl", [TEXT, TEXT, record])
    with pytest.raises(BadRecordError, match=rf"bad.jsonl: record 2 \(line 3\).*{message}"):
        open_prompts(path, eval_fraction=0)
    prompts = open_prompts(path, eval_fraction=0, check=False)  # found on access instead
    assert prompts[0].text == TEXT["prompt"]
    with pytest.raises(BadRecordError, match=message):
        prompts[2]


def test_invalid_json_record(tmp_path):
    (tmp_path / "bad.jsonl").write_text(json.dumps(TEXT) + "\n{not json\n")
    with pytest.raises(BadRecordError, match=r"bad.jsonl: record 1 \(line 2\): not valid JSON"):
        open_prompts(str(tmp_path / "bad.jsonl"), eval_fraction=0)


def test_parse_prompt_none_fields_are_absent():
    rec = parse_prompt({"prompt": "x", "messages": None, "tools": None, "answer": None}, "mem: record 0")
    assert rec.text == "x" and rec.fields == {"answer": None}


# --- PromptIterator -----------------------------------------------------------------------------------


def test_epoch_permutation():
    perms = [epoch_permutation(50, 3, e) for e in range(3)]
    for p in perms:
        assert sorted(p.tolist()) == list(range(50))
    assert perms[0].tolist() != perms[1].tolist()
    np.testing.assert_array_equal(epoch_permutation(50, 3, 1), perms[1])
    assert epoch_permutation(50, 4, 0).tolist() != perms[0].tolist()
    assert sorted(epoch_permutation(7, -1, 2 ** 40).tolist()) == list(range(7))


def test_prompt_iterator_epochs_and_resume():
    prompts = list(range(10))  # any random-access sequence
    it = PromptIterator(prompts, batch_size=4, seed=1)
    batches = [next(it) for _ in range(5)]  # 20 prompts: two full epochs, batches across the boundary
    flat = [x for b in batches for x in b]
    assert all(len(b) == 4 for b in batches)
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]

    it = PromptIterator(prompts, 4, seed=1)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # JSON-serialisable
    expected = [next(it) for _ in range(6)]
    resumed = PromptIterator(prompts, 4, seed=1)
    resumed.set_state(state)
    assert [next(resumed) for _ in range(6)] == expected
    assert expected[:2] == batches[3:5]
    with pytest.raises(ValueError, match="seed"):
        PromptIterator(prompts, 4, seed=2).set_state(state)
    with pytest.raises(ValueError, match="prompts"):
        PromptIterator(list(range(11)), 4, seed=1).set_state(state)


def test_prompt_iterator_over_prompt_set(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)])
    ps = open_prompts(path, eval_fraction=0)
    it = PromptIterator(ps, batch_size=7, seed=0)  # larger than the set: spans epochs
    batch = next(it)
    assert len(batch) == 7 and {r.text for r in batch[:5]} == {f"q{i}" for i in range(5)}
    assert it.get_state() == {"seed": 0, "num_prompts": 5, "epoch": 1, "position": 2}
    with pytest.raises(ValueError, match="batch_size"):
        PromptIterator(ps, 0)


def test_prompt_pattern_keeps_matching_prompts_in_both_splits():
    """``train.rl.prompt_pattern``: the prompts whose last message the regex finds, taken after the split, so the
    held-out ones stay the chat fine-tune's held-out conversations."""
    pattern = r"^How many chapters"
    splits = {s: open_prompts("bundled", split=s, eval_fraction=0.1, pattern=pattern) for s in ("train", "eval")}
    every = {s: open_prompts("bundled", split=s, eval_fraction=0.1) for s in ("train", "eval")}
    for s, kept in splits.items():
        assert 0 < len(kept) < len(every[s])
        assert set(kept.indices) <= set(every[s].indices)
        assert all(kept[i].messages[-1]["content"].startswith("How many chapters") for i in range(len(kept)))
        assert len(kept) == sum(every[s][i].messages[-1]["content"].startswith("How many chapters")
                                for i in range(len(every[s])))
    assert not set(splits["train"].indices) & set(splits["eval"].indices)
