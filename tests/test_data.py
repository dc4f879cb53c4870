"""k3jax.data: tokenizers, sources, packing, targets, shuffling, sharding and checkpointing."""

import dataclasses
import json

import numpy as np
import pytest

from k3jax.config import DataConfig, TrainConfig
from k3jax.data import batch_summary, bundled_corpus_path, make_train_dataset, open_documents, split_indices
from k3jax.data.pipeline import document_hash
from k3jax.data.sources import split_text_documents
from k3jax.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

KEYS = {"tokens": np.int32, "segment_ids": np.int32, "positions": np.int32, "targets": np.int32,
        "loss_mask": np.float32}


def _docs(n=60, seed=0):
    """Distinct documents of very different lengths (some longer than a row)."""
    r = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "lambda"]
    out = []
    for i in range(n):
        k = int(r.integers(1, 40))
        out.append(f"doc{i}: " + " ".join(words[j] for j in r.integers(0, len(words), k)) + f" end{i}.")
    return out


class ListSource:
    def __init__(self, docs):
        self.docs = list(docs)

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        return self.docs[i]


def _cfg(batch=4, seq=32, seed=0, **data) -> TrainConfig:
    data = {"eval_fraction": 0.1, **data}
    return TrainConfig(batch_size=batch, seq_len=seq, seed=seed, data=DataConfig(**data))


def _take(ds_or_it, n):
    it = iter(ds_or_it)
    return [next(it) for _ in range(n)]


class EosByteTokenizer(ByteTokenizer):
    """Bytes plus BOS = 256 and EOS = 257."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257


def _check_row_structure(b, seq):
    for k, dt in KEYS.items():
        assert b[k].dtype == dt, k
        assert b[k].shape[1] == seq
    for row in range(b["tokens"].shape[0]):
        seg, pos = b["segment_ids"][row], b["positions"][row]
        real = seg > 0
        # padding only at the end of the row, fully masked
        if (~real).any():
            first_pad = int(np.argmin(real))
            assert not real[first_pad:].any()
        assert np.all(b["tokens"][row][~real] == 0)
        assert np.all(b["targets"][row][~real] == -1)
        np.testing.assert_array_equal(b["loss_mask"][row], real.astype(np.float32))
        assert np.all(b["targets"][row][real] >= 0)
        # segments: 1, 2, ..., k, each contiguous, positions restart at 0
        ids = seg[real]
        if ids.size:
            assert ids[0] == 1 and np.all(np.diff(ids) >= 0) and np.all(np.diff(ids) <= 1)
            for s in np.unique(ids):
                where = np.nonzero(seg == s)[0]
                assert np.all(np.diff(where) == 1)
                np.testing.assert_array_equal(pos[where], np.arange(where.size))


def _pieces(b):
    """(inputs, targets) of every packed piece in a batch."""
    out = []
    for row in range(b["tokens"].shape[0]):
        seg = b["segment_ids"][row]
        for s in np.unique(seg[seg > 0]):
            where = seg == s
            out.append((b["tokens"][row][where], b["targets"][row][where]))
    return out


# ----------------------------------------------------------------------------------------------
# Packing and targets


def test_packing_structure_and_targets_stay_inside_documents():
    docs = _docs()
    encoded = [d.encode() for d in docs]
    ds = make_train_dataset(_cfg(), ByteTokenizer(), documents=ListSource(docs))
    for b in _take(ds, 12):
        _check_row_structure(b, 32)
        for inputs, targets in _pieces(b):
            # inside a piece the target is the next input ...
            np.testing.assert_array_equal(targets[:-1], inputs[1:])
            # ... and the whole piece plus its last target is a contiguous run of ONE document
            run = bytes(inputs.tolist() + [int(targets[-1])])
            assert sum(run in e for e in encoded) >= 1, run
            # the byte tokenizer has no EOS: a document's last byte is never an input
            assert not any(e.endswith(bytes(inputs.tolist())) and len(inputs) == len(e) for e in encoded)


def test_bos_and_eos_are_added_and_last_token_predicts_eos():
    docs = _docs(20)
    ds = make_train_dataset(_cfg(seq=128, eval_fraction=0.0, num_epochs=1, shuffle=False), EosByteTokenizer(),
                            documents=ListSource(docs))
    pieces = [p for b in ds for p in _pieces(b)]
    starts = [p for p in pieces if p[0][0] == 256]
    ends = [p for p in pieces if p[1][-1] == 257]
    assert len(starts) >= 10 and len(ends) >= 10  # one epoch, less the dropped last partial batch
    for inputs, targets in pieces:
        assert 257 not in inputs.tolist()  # EOS is only ever a target
        assert 256 not in targets.tolist()  # BOS is only ever an input
        assert 256 not in inputs[1:].tolist()  # BOS only at a document start
    # a complete short document: BOS + text -> text + EOS
    for inputs, targets in pieces:
        if inputs[0] == 256 and targets[-1] == 257:
            text = bytes(inputs[1:].tolist()).decode()
            assert text in docs
            break
    else:
        pytest.fail("no complete document found")


def test_long_documents_are_split_into_pieces():
    doc = "x" * 50 + "y" * 50  # 100 bytes -> 99 pairs -> pieces of 32, 32, 32, 3
    ds = make_train_dataset(_cfg(batch=2, eval_fraction=0.0, num_epochs=1, shuffle=False), ByteTokenizer(),
                            documents=ListSource([doc, "short one"]))
    pieces = [p for b in ds for p in _pieces(b)]
    lengths = sorted(len(p[0]) for p in pieces if p[0][0] in (ord("x"), ord("y")))
    assert lengths == [3, 32, 32, 32]
    joined = sorted(pieces, key=lambda p: -len(p[0]))
    assert all(len(p[0]) <= 32 for p in joined)


def test_padding_is_small_on_the_bundled_corpus():
    ds = make_train_dataset(_cfg(batch=8, seq=128), ByteTokenizer())
    pad = [batch_summary(b)["padding_fraction"] for b in _take(ds, 20)]
    assert np.mean(pad) < 0.1, pad


# ----------------------------------------------------------------------------------------------
# Shuffling, epochs, sharding, eval split


def test_deterministic_by_seed_and_seeds_differ():
    src = ListSource(_docs())
    a = _take(make_train_dataset(_cfg(seed=3), ByteTokenizer(), documents=src), 4)
    b = _take(make_train_dataset(_cfg(seed=3), ByteTokenizer(), documents=src), 4)
    c = _take(make_train_dataset(_cfg(seed=4), ByteTokenizer(), documents=src), 4)
    for x, y in zip(a, b):
        for k in KEYS:
            np.testing.assert_array_equal(x[k], y[k])
    assert any(not np.array_equal(x["tokens"], z["tokens"]) for x, z in zip(a, c))


def test_epochs_are_finite_when_asked_and_reshuffled():
    src = ListSource(_docs(30))
    cfg = _cfg(eval_fraction=0.0, num_epochs=2)
    n2 = sum(1 for _ in make_train_dataset(cfg, ByteTokenizer(), documents=src))
    n1 = sum(1 for _ in make_train_dataset(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, num_epochs=1)),
                                           ByteTokenizer(), documents=src))
    assert n1 > 0 and n2 >= 2 * n1 - 1


def _doc_ids(batches):
    """The doc numbers present ("docN:" prefixes) in a list of batches."""
    ids = set()
    for b in batches:
        for inputs, _ in _pieces(b):
            text = bytes(inputs.tolist()).decode(errors="replace")
            if text.startswith("doc") and ":" in text[:8]:
                ids.add(int(text[3:text.index(":")]))
    return ids


def test_process_sharding_is_disjoint_and_covering():
    docs = _docs(90)
    src = ListSource(docs)
    cfg = _cfg(batch=6, seq=256, eval_fraction=0.9, shuffle=False)  # eval split: every doc, no drop
    expected = set(split_indices(len(docs), 0.9, "eval").tolist())
    seen = []
    for p in range(3):
        ds = make_train_dataset(cfg, ByteTokenizer(), split="eval", process_index=p, process_count=3, documents=src)
        batches = list(ds)
        assert all(b["tokens"].shape == (2, 256) for b in batches)  # 6 rows / 3 processes
        seen.append(_doc_ids(batches))
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])
    assert seen[0] | seen[1] | seen[2] == expected
    # train split: the three processes also read disjoint documents
    train = [_doc_ids(_take(make_train_dataset(_cfg(batch=3, seq=256), ByteTokenizer(), process_index=p,
                                               process_count=3, documents=src), 8)) for p in range(3)]
    assert not (train[0] & train[1]) and not (train[1] & train[2]) and not (train[0] & train[2])
    with pytest.raises(ValueError, match="divisible"):
        make_train_dataset(_cfg(batch=4), ByteTokenizer(), process_index=0, process_count=3, documents=src)


def test_eval_split_is_deterministic_and_disjoint_from_train():
    n = 1000
    ev, tr = split_indices(n, 0.05, "eval"), split_indices(n, 0.05, "train")
    assert not set(ev) & set(tr) and len(ev) + len(tr) == n
    assert 20 < len(ev) < 80
    np.testing.assert_array_equal(ev, split_indices(n, 0.05, "eval"))
    np.testing.assert_array_equal(document_hash(np.arange(5)), document_hash(np.arange(5)))
    assert len(split_indices(3, 0.001, "eval")) == 1  # at least one eval document
    assert len(split_indices(10, 0.0, "eval")) == 0
    docs = _docs(40)
    cfg = _cfg(eval_fraction=0.2)
    ev_ids = _doc_ids(make_train_dataset(cfg, ByteTokenizer(), split="eval", documents=ListSource(docs)))
    tr_ids = _doc_ids(_take(make_train_dataset(cfg, ByteTokenizer(), documents=ListSource(docs)), 30))
    assert ev_ids and not ev_ids & tr_ids
    # eval batches are padded to the full batch size
    for b in make_train_dataset(cfg, ByteTokenizer(), split="eval", documents=ListSource(docs)):
        assert b["tokens"].shape == (4, 32)
        _check_row_structure(b, 32)


# ----------------------------------------------------------------------------------------------
# Checkpointing


def test_restored_iterator_yields_exactly_the_next_batch():
    src = ListSource(_docs())
    cfg = _cfg()
    it = iter(make_train_dataset(cfg, ByteTokenizer(), documents=src))
    for _ in range(7):
        next(it)
    state = it.get_state()
    state = json.loads(json.dumps(state))  # it must survive a JSON round trip (grain checkpoints)
    expected = [next(it) for _ in range(5)]
    it2 = iter(make_train_dataset(cfg, ByteTokenizer(), documents=src))
    it2.set_state(state)
    for e in expected:
        got = next(it2)
        for k in KEYS:
            np.testing.assert_array_equal(got[k], e[k])


def test_restore_across_an_epoch_boundary():
    src = ListSource(_docs(12))
    cfg = _cfg(eval_fraction=0.0)
    it = iter(make_train_dataset(cfg, ByteTokenizer(), documents=src))
    batches = [next(it) for _ in range(40)]  # several epochs of 12 short documents
    it2 = iter(make_train_dataset(cfg, ByteTokenizer(), documents=src))
    for _ in range(25):
        next(it2)
    state = it2.get_state()
    it3 = iter(make_train_dataset(cfg, ByteTokenizer(), documents=src))
    it3.set_state(state)
    for e in batches[25:40]:
        np.testing.assert_array_equal(next(it3)["tokens"], e["tokens"])


# ----------------------------------------------------------------------------------------------
# Sources


def test_text_source_blank_line_blocks(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("first doc\nline two\n\n\nsecond doc\n  \nthird\r\n\r\nfourth\n")
    docs = open_documents(str(f))
    assert [docs[i] for i in range(len(docs))] == ["first doc\nline two", "second doc", "third", "fourth"]
    assert split_text_documents("no blank lines\nhere") == ["no blank lines\nhere"]
    g = tmp_path / "b.txt"
    g.write_text("other file")
    both = open_documents(str(tmp_path / "*.txt"))
    assert len(both) == 5 and both[4] == "other file"
    assert len(open_documents(str(tmp_path))) == 5  # a directory


def test_jsonl_source(tmp_path):
    f = tmp_path / "d.jsonl"
    rows = [{"text": f"hello {i}", "id": i} for i in range(5)]
    f.write_text("\n".join(json.dumps(r) for r in rows[:3]) + "\n\n" + "\n".join(json.dumps(r) for r in rows[3:]) + "\n")
    docs = open_documents(str(f))
    assert len(docs) == 5 and docs[4] == "hello 4" and docs[0] == "hello 0"
    other = open_documents(str(f), text_field="text")
    assert other[2] == "hello 2"
    with pytest.raises(ValueError, match="no field 'body'.*fields: \\['id', 'text'\\]"):
        open_documents(str(f), text_field="body")
    # a whole training dataset from it
    cfg = _cfg(batch=2, seq=16, eval_fraction=0.0, num_epochs=1, source=str(f))
    b = next(iter(make_train_dataset(cfg, ByteTokenizer())))
    _check_row_structure(b, 16)


def test_missing_and_unknown_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_documents(str(tmp_path / "nope.txt"))
    with pytest.raises(FileNotFoundError, match="no file matches"):
        open_documents(str(tmp_path / "*.jsonl"))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match="cannot tell the format"):
        open_documents(str(tmp_path / "x.csv"))
    assert len(open_documents(str(tmp_path / "x.csv"), format="text")) == 1
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="no documents"):
        open_documents(str(tmp_path / "empty.txt"))


def test_arrayrecord_source(tmp_path):
    ar = pytest.importorskip("array_record.python.array_record_module")
    path = str(tmp_path / "d.arrayrecord")
    w = ar.ArrayRecordWriter(path, "group_size:1")
    w.write(b"plain text record")
    w.write(json.dumps({"text": "json record"}).encode())
    w.close()
    docs = open_documents(path)
    assert len(docs) == 2 and docs[0] == "plain text record" and docs[1] == "json record"


def test_parquet_source(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["one", "two", "three"], "n": [1, 2, 3]}), path)
    docs = open_documents(str(path))
    assert [docs[i] for i in range(3)] == ["one", "two", "three"]
    with pytest.raises(ValueError, match="no column 'body'"):
        open_documents(str(path), text_field="body")


def test_bundled_corpus():
    path = bundled_corpus_path()
    size = path.stat().st_size
    assert 500_000 < size < 2_500_000, size
    docs = open_documents("bundled")
    assert len(docs) == 236  # the chapters of Genesis .. Ruth
    assert docs[0].startswith("Genesis 1\nIn the beginning God created the heaven and the earth.")
    assert docs[len(docs) - 1].startswith("Ruth 4\n")
    text = path.read_text()
    assert text.isascii()
    assert (path.parent / "README.md").exists()
    assert len(split_indices(len(docs), DataConfig().eval_fraction, "eval")) >= 1


# ----------------------------------------------------------------------------------------------
# Tokenizers


def test_byte_tokenizer_round_trip():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert tok.vocab_size == 256 and tok.bos_id is None and tok.eos_id is None
    for text in ["", "In the beginning", "naïve café — 日本語 🙂", "\n\t\x00"]:
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
    assert tok.decode([0xE6, 0x97]) == "\ufffd"  # a cut multi-byte character decodes, replaced


def _train_tiny_bpe(directory, with_config=True):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers, decoders

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["In the beginning God created the heaven and the earth."] * 20 + ["And the earth was without form."] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(directory / "tokenizer.json"))
    if with_config:
        (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    return tok


def test_hf_tokenizer_json(tmp_path):
    ref = _train_tiny_bpe(tmp_path)
    for spec in (str(tmp_path / "tokenizer.json"), str(tmp_path)):
        tok = load_tokenizer(spec)
        assert isinstance(tok, HFTokenizer)
        assert tok.vocab_size == ref.get_vocab_size()
        assert tok.bos_id == ref.token_to_id("<s>") and tok.eos_id == ref.token_to_id("</s>")
        text = "In the beginning God created the earth."
        ids = tok.encode(text)
        assert len(ids) < len(text)  # merges happened
        assert tok.decode(ids) == text
    # without tokenizer_config.json the common spellings are found
    sub = tmp_path / "noconf"
    sub.mkdir()
    _train_tiny_bpe(sub, with_config=False)
    tok = load_tokenizer(str(sub / "tokenizer.json"))
    assert tok.eos_id == ref.token_to_id("</s>") and tok.bos_id == ref.token_to_id("<s>")
    # and the pipeline adds them
    ds = make_train_dataset(_cfg(batch=2, seq=16, eval_fraction=0.0, shuffle=False), tok,
                            documents=ListSource(["In the beginning", "And the earth"]))
    b = next(iter(ds))
    assert tok.bos_id in b["tokens"] and tok.eos_id in b["targets"]


def test_tiktoken_model_delegates_to_kimi_tokenizer(tmp_path):
    pytest.importorskip("tiktoken")
    kt = pytest.importorskip("k3jax.tokenizer")
    import base64

    lines = [f"{base64.b64encode(bytes([i])).decode()} {i}" for i in range(256)]
    lines.append(f"{base64.b64encode(b'th').decode()} 256")
    (tmp_path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {"257": {"content": "[BOS]"}, "258": {"content": "[EOS]"}},
        "bos_token": "[BOS]", "eos_token": "[EOS]"}))
    for spec in (str(tmp_path), str(tmp_path / "tiktoken.model")):
        tok = load_tokenizer(spec)
        assert isinstance(tok, kt.Tokenizer)
        assert tok.bos_id == 257 and tok.eos_id == 258
        ids = tok.encode("the earth")
        assert 256 in ids and tok.decode(ids) == "the earth"


def test_bad_tokenizer_spec(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="neither tokenizer.json nor tiktoken.model"):
        load_tokenizer(str(tmp_path))


def test_tokenizer_errors_name_where_the_spec_came_from(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^train\.data\.tokenizer: .* is neither 'byte'"):
        load_tokenizer(str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="^--tokenizer: directory .* has neither"):
        load_tokenizer(str(tmp_path), source="--tokenizer")
    (tmp_path / "vocab.txt").write_text("")
    with pytest.raises(ValueError, match="^--tokenizer: cannot tell the format"):
        load_tokenizer(str(tmp_path / "vocab.txt"), source="--tokenizer")
