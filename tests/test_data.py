"""Tests for lossysim.data: loading, capping, tokenising, caching, batching (all offline)."""
from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch

from lossysim import data as D
from lossysim.config import ExperimentConfig

LABEL_NAMES = ("entailment", "neutral", "contradiction")


def config(dataset, **changes) -> ExperimentConfig:
    values = dict(dataset=str(dataset), tokenizer="bpe", max_length=32, max_train_samples=None,
                  max_eval_samples=None, seed=0)
    values.update(changes)
    return ExperimentConfig(**values)


def mnli_record(i: int, label: str) -> dict:
    """A line shaped like multinli_1.0_*.jsonl (extra fields included, as in the real files)."""
    return {"annotator_labels": [label], "genre": "fiction", "gold_label": label, "pairID": f"{i}e",
            "promptID": str(i), "sentence1": f"premise number {i} about a red car.",
            "sentence1_binary_parse": "( x )", "sentence1_parse": "(ROOT x)",
            "sentence2": f"hypothesis {i} says something.", "sentence2_binary_parse": "( y )",
            "sentence2_parse": "(ROOT y)"}


def cycle_labels(n: int, dash_every: int = 0) -> list[str]:
    return ["-" if dash_every and i % dash_every == dash_every - 1 else LABEL_NAMES[i % 3] for i in range(n)]


def write_jsonl(path, labels, offset: int = 0) -> None:
    path.write_text("".join(json.dumps(mnli_record(offset + i, y)) + "\n" for i, y in enumerate(labels)))


def jsonl_dir(tmp_path, n_train=60, n_eval=12, dash_every=0):
    folder = tmp_path / "mnli_jsonl"
    folder.mkdir()
    names = D.FILE_SETS["jsonl"]
    write_jsonl(folder / names["train"], cycle_labels(n_train, dash_every))
    write_jsonl(folder / names["validation_matched"], cycle_labels(n_eval, dash_every), offset=10_000)
    write_jsonl(folder / names["validation_mismatched"], cycle_labels(n_eval, dash_every), offset=20_000)
    return folder


GLUE_TRAIN_HEADER = ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
                     "sentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label")
GLUE_DEV_HEADER = ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
                   "sentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tlabel2\tlabel3\tlabel4\t"
                   "label5\tgold_label")


def glue_tsv(path, labels, dev: bool, offset: int = 0) -> None:
    """GLUE's MNLI TSV layout (no quoting: sentences may hold quotes)."""
    lines = [GLUE_DEV_HEADER if dev else GLUE_TRAIN_HEADER]
    for i, label in enumerate(labels, start=offset):
        votes = [label] * (5 if dev else 1)
        lines.append("\t".join([str(i), str(i), f"{i}n", "slate", "( x )", "( y )", "(ROOT x)", "(ROOT y)",
                                f'the "quoted" premise {i}', f"hypothesis {i}", *votes, label]))
    path.write_text("\r\n".join(lines) + "\r\n")


def tsv_dir(tmp_path, n_train=30, n_eval=9):
    folder = tmp_path / "glue_mnli"
    folder.mkdir()
    names = D.FILE_SETS["tsv"]
    glue_tsv(folder / names["train"], cycle_labels(n_train), dev=False)
    glue_tsv(folder / names["validation_matched"], cycle_labels(n_eval, dash_every=4), dev=True, offset=100)
    glue_tsv(folder / names["validation_mismatched"], cycle_labels(n_eval), dev=True, offset=200)
    return folder


def same_splits(a, b) -> bool:
    return all(torch.equal(a.splits[s][k], b.splits[s][k]) for s in D.SPLITS for k in a.splits[s])


# --------------------------------------------------------------------------- local files

def test_jsonl_directory_maps_labels_and_drops_dash(tmp_path):
    folder = jsonl_dir(tmp_path, n_train=40, n_eval=12, dash_every=4)
    prepared = D.prepare_data(config(folder), tmp_path / "cache")
    expected = [LABEL_NAMES.index(y) for y in cycle_labels(40, 4) if y != "-"]
    train = prepared.splits["train"]
    assert train["labels"].tolist() == expected            # uncapped keeps file order
    assert len(prepared.splits["validation_matched"]["labels"]) == 9
    for split in D.SPLITS:
        tensors = prepared.splits[split]
        assert tensors["input_ids"].dtype == tensors["attention_mask"].dtype == tensors["labels"].dtype == torch.long
        width = int(tensors["attention_mask"].sum(1).max())     # the longest row, not max_length
        assert tensors["input_ids"].shape == tensors["attention_mask"].shape == (len(tensors["labels"]), width)
        assert width <= 32
    assert prepared.num_labels == 3 and prepared.vocab_size == len(prepared.tokenizer)
    assert prepared.pad_token_id == prepared.tokenizer.pad_token_id
    # the encoded text is premise, newline, hypothesis of the first kept row
    first = prepared.tokenizer.decode(train["input_ids"][0][train["attention_mask"][0].bool()])
    assert first == "premise number 0 about a red car.\nhypothesis 0 says something."
    assert prepared.info["label_counts"]["train"] == [expected.count(k) for k in range(3)]
    assert prepared.name == D.display_name(str(folder))


def test_glue_tsv_directory(tmp_path):
    folder = tsv_dir(tmp_path)
    examples = D.load_examples(config(folder))
    assert examples["train"].label == [i % 3 for i in range(30)]
    assert examples["train"].premise[4] == 'the "quoted" premise 4'      # quotes kept, CRLF stripped
    assert examples["train"].hypothesis[4] == "hypothesis 4"
    matched = [LABEL_NAMES.index(y) for y in cycle_labels(9, dash_every=4) if y != "-"]
    assert examples["validation_matched"].label == matched
    assert len(examples["validation_mismatched"]) == 9


def test_tsv_label_column_with_ints_and_minus_one(tmp_path):
    path = tmp_path / "pairs.tsv"
    rows = ["premise\thypothesis\tlabel"] + [f"p{i}\th{i}\t{[0, 1, 2, -1][i % 4]}" for i in range(40)]
    path.write_text("\n".join(rows) + "\n")
    examples = D.load_examples(config(path))
    everything = examples["train"].label + examples["validation_matched"].label
    assert sorted(everything) == sorted([i % 4 for i in range(40) if i % 4 != 3])


def test_single_file_holds_out_every_tenth_row(tmp_path):
    path = tmp_path / "one.jsonl"
    write_jsonl(path, cycle_labels(50))
    examples = D.load_examples(config(path))
    held = [f"premise number {i} about a red car." for i in range(9, 50, D.HOLDOUT_EVERY)]
    assert examples["validation_matched"].premise == held
    assert examples["validation_mismatched"].premise == held
    assert len(examples["train"]) == 45 and not set(examples["train"].premise) & set(held)
    # capped eval splits of a single file are still the same rows
    capped = D.load_examples(config(path, max_eval_samples=3, seed=4))
    assert capped["validation_matched"].premise == capped["validation_mismatched"].premise
    assert len(capped["validation_matched"]) == 3



def test_one_held_out_set_is_evaluated_once(tmp_path):
    """A single file's held-out rows serve both eval splits: a run evaluates them once, not twice;
    a directory with two different eval files keeps both."""
    path = tmp_path / "one.jsonl"
    write_jsonl(path, cycle_labels(50))
    single = D.prepare_data(config(path), tmp_path / "cache")
    assert single.eval_splits == ("validation_matched",)
    two = D.prepare_data(config(jsonl_dir(tmp_path)), tmp_path / "cache")
    assert two.eval_splits == ("validation_matched", "validation_mismatched")

# --------------------------------------------------------------------------- caps

def test_caps_deterministic_seeded_and_eval_stable(tmp_path):
    folder = jsonl_dir(tmp_path, n_train=300, n_eval=60, dash_every=7)
    base = config(folder, max_train_samples=40, max_eval_samples=15)
    first = D.load_examples(base)
    again = D.load_examples(base)
    other_seed = D.load_examples(base.replace(seed=1))
    other_train_cap = D.load_examples(base.replace(max_train_samples=80))
    assert len(first["train"]) == 40 and len(first["validation_matched"]) == 15
    for split in D.SPLITS:
        assert first[split].premise == again[split].premise
    assert set(first["train"].premise) != set(other_seed["train"].premise)
    assert set(first["validation_matched"].premise) != set(other_seed["validation_matched"].premise)
    # the eval subset does not depend on the training cap
    assert first["validation_matched"].premise == other_train_cap["validation_matched"].premise
    # a cap keeps only labelled rows, and the rows are a subset of the file
    all_rows = D.load_examples(config(folder))
    assert set(first["train"].premise) <= set(all_rows["train"].premise)
    # prepared tensors are identical across independent runs (separate caches)
    a = D.prepare_data(base, tmp_path / "cache_a")
    b = D.prepare_data(base, tmp_path / "cache_b")
    assert same_splits(a, b)


def test_cap_parses_only_the_rows_it_keeps(tmp_path, monkeypatch):
    path = tmp_path / "big.jsonl"
    write_jsonl(path, cycle_labels(2000))
    parsed = []
    original = D.sources._LineFile._row
    monkeypatch.setattr(D.sources._LineFile, "_row", lambda self, i: parsed.append(i) or original(self, i))
    examples = D.load_examples(config(path, max_train_samples=25, max_eval_samples=5))
    assert len(examples["train"]) == 25
    assert len(parsed) == 25 + 5        # no dropped rows here: exactly one parse per kept row


def test_cap_larger_than_data_keeps_everything(tmp_path):
    folder = jsonl_dir(tmp_path, n_train=30, n_eval=6, dash_every=5)
    capped = D.load_examples(config(folder, max_train_samples=10_000))
    assert sorted(capped["train"].premise) == sorted(D.load_examples(config(folder))["train"].premise)


# --------------------------------------------------------------------------- cache and ranks

def test_cache_hit_reuses_tensors_without_tokenising(tmp_path, monkeypatch):
    folder = jsonl_dir(tmp_path)
    calls = {"tokenize": 0}
    original = D.tokenize_examples

    def counting(*args, **kwargs):
        calls["tokenize"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(D.prepare, "tokenize_examples", counting)
    first = D.prepare_data(config(folder, max_train_samples=20), tmp_path / "cache")
    assert calls["tokenize"] == 3
    second = D.prepare_data(config(folder, max_train_samples=20), tmp_path / "cache")
    assert calls["tokenize"] == 3 and second.cache_path == first.cache_path
    assert same_splits(first, second)
    # any ingredient of the key gives a new cache entry
    for change in ({"seed": 1}, {"max_train_samples": 21}, {"max_eval_samples": 5}, {"max_length": 16},
                   {"tokenizer": "bytes"}):
        changed = config(folder, **{"max_train_samples": 20, **change})
        assert D.cache_path(changed, tmp_path / "cache") != first.cache_path


def test_cached_tokenizer_reproduces_the_ids(tmp_path):
    folder = jsonl_dir(tmp_path)
    cfg = config(folder)
    built_tokenizer, built, _ = D.build(cfg)
    prepared = D.prepare_data(cfg, tmp_path / "cache")
    for split in D.SPLITS:
        for key in ("input_ids", "attention_mask", "labels"):
            assert torch.equal(built[split][key], prepared.splits[split][key])
    examples = D.load_examples(cfg)["validation_matched"]
    again = D.tokenize_examples(prepared.tokenizer, examples, cfg.max_length)
    assert torch.equal(again["input_ids"], prepared.splits["validation_matched"]["input_ids"])
    assert built_tokenizer.get_vocab() == prepared.tokenizer.get_vocab()


def test_other_ranks_wait_then_read_the_same_cache(tmp_path, monkeypatch):
    folder = jsonl_dir(tmp_path)
    cfg = config(folder, max_train_samples=30)
    barrier = threading.Barrier(2, timeout=120)
    loads = []
    original = D.load_examples
    monkeypatch.setattr(D.prepare, "load_examples", lambda c: loads.append(threading.current_thread().name) or original(c))
    results = {}

    def rank(is_main):
        results[is_main] = D.prepare_data(cfg, tmp_path / "cache", is_main=is_main, barrier=barrier.wait)

    worker = threading.Thread(target=rank, args=(False,), name="rank1")
    worker.start()                                  # rank 1 starts first and must wait for rank 0
    rank(True)
    worker.join()
    assert loads == [threading.current_thread().name]   # only rank 0 loaded the dataset
    assert same_splits(results[True], results[False])
    assert results[False].tokenizer.get_vocab() == results[True].tokenizer.get_vocab()


def test_other_rank_without_cache_fails_clearly(tmp_path):
    with pytest.raises(ValueError, match="rank 0"):
        D.prepare_data(config("synthetic", max_train_samples=9, max_eval_samples=3), tmp_path, is_main=False)


def test_main_failure_releases_the_other_ranks(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    barrier = threading.Barrier(2, timeout=60)
    errors = {}

    def rank(is_main):
        try:
            D.prepare_data(config(bad), tmp_path / "cache", is_main=is_main, barrier=barrier.wait)
        except ValueError as err:
            errors[is_main] = str(err)

    worker = threading.Thread(target=rank, args=(False,))
    worker.start()
    rank(True)
    worker.join(timeout=60)
    assert "bad.jsonl line 1: malformed JSON" in errors[True] and "rank 0" in errors[False]


# --------------------------------------------------------------------------- bad input

def test_missing_file_in_directory_is_named(tmp_path):
    folder = jsonl_dir(tmp_path)
    missing = folder / D.FILE_SETS["jsonl"]["validation_mismatched"]
    missing.unlink()
    with pytest.raises(ValueError, match=re.escape(str(missing))):
        D.load_examples(config(folder))


def test_directory_without_mnli_files_lists_expected_names(tmp_path):
    with pytest.raises(ValueError, match="multinli_1.0_train.jsonl.*train.tsv"):
        D.load_examples(config(tmp_path))


@pytest.mark.parametrize("bad_line, message", [
    ('{"sentence1": "a", "sentence2": "b", "gold_label": "neutral"', "malformed JSON"),
    ('["not", "an", "object"]', "expected a JSON object"),
    ('{"sentence1": "a", "gold_label": "neutral"}', "missing field sentence2"),
    ('{"sentence1": "a", "sentence2": "b", "gold_label": "maybe"}', "label 'maybe'"),
    ('{"sentence1": 3, "sentence2": "b", "gold_label": "neutral"}', "must be strings"),
])
def test_malformed_jsonl_line_is_named_with_its_number(tmp_path, bad_line, message):
    path = tmp_path / "bad.jsonl"
    good = [json.dumps(mnli_record(i, "neutral")) for i in range(5)]
    path.write_text("\n".join(good[:2] + [""] + [bad_line] + good[2:]) + "\n")   # blank line 3, bad line 4
    with pytest.raises(ValueError, match=rf"bad\.jsonl line 4: .*{re.escape(message)}"):
        D.load_examples(config(path))


def test_malformed_tsv_line_is_named_with_its_number(tmp_path):
    folder = tsv_dir(tmp_path)
    train = folder / "train.tsv"
    lines = train.read_text().splitlines()
    lines[6] = "only\tthree\tcolumns"
    train.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"train\.tsv line 7: expected at least 12 tab-separated columns"):
        D.load_examples(config(folder))


def test_tsv_without_needed_columns(tmp_path):
    path = tmp_path / "x.tsv"
    path.write_text("a\tb\tc\n1\t2\t3\n")
    with pytest.raises(ValueError, match=r"x\.tsv line 1: header lacks a column named sentence1 or premise"):
        D.load_examples(config(path))


@pytest.mark.parametrize("name", ["glue", "mnli_local_typo", "/no/such/dir"])
def test_unknown_dataset_lists_what_is_accepted(name):
    with pytest.raises(ValueError, match="synthetic.*mnli.*multinli_1.0_train.jsonl"):
        D.prepare_data(config(name), "/tmp/unused-cache")


def test_wrong_file_type(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("x\n")
    with pytest.raises(ValueError, match=r"expected a \.jsonl or \.tsv file"):
        D.load_examples(config(path))


def test_split_without_labelled_rows(tmp_path):
    folder = jsonl_dir(tmp_path)
    write_jsonl(folder / D.FILE_SETS["jsonl"]["validation_matched"], ["-", "-"])
    with pytest.raises(ValueError, match="validation_matched has no labelled examples"):
        D.load_examples(config(folder))


# --------------------------------------------------------------------------- tokenizers

def test_empty_vocabulary_is_rejected_with_advice(tmp_path):
    from transformers import GPT2Tokenizer
    empty = GPT2Tokenizer.from_pretrained("gpt2")      # offline: transformers returns an EMPTY tokenizer
    with pytest.raises(ValueError, match="empty vocabulary.*tokenizer: bpe"):
        D.check_vocabulary(empty, "gpt2")
    folder = tmp_path / "empty_tokenizer"
    empty.save_pretrained(folder)
    with pytest.raises(ValueError, match="empty vocabulary.*tokenizer: bpe.*local directory.*go online"):
        D.prepare_data(config("synthetic", tokenizer=str(folder), max_train_samples=9, max_eval_samples=3),
                       tmp_path / "cache")


def test_hub_tokenizer_offline_fails_fast_with_advice(tmp_path):
    start = time.perf_counter()
    with pytest.raises(ValueError, match="tokenizer 'gpt2' could not be loaded.*tokenizer: bpe"):
        D.prepare_data(config("synthetic", tokenizer="auto", model="gpt2", max_train_samples=9,
                              max_eval_samples=3), tmp_path)
    assert time.perf_counter() - start < 30


def test_tokenizer_auto_resolution():
    assert D.tokenizer_spec(config("synthetic", tokenizer="auto", model="tiny")) == "bpe"
    assert D.tokenizer_spec(config("synthetic", tokenizer="auto", model="distilgpt2")) == "distilgpt2"
    assert D.tokenizer_spec(config("synthetic", tokenizer="bytes", model="gpt2")) == "bytes"


def test_local_tokenizer_directory_gets_a_pad_token(tmp_path):
    """A GPT-2-like tokenizer without pad: EOS becomes pad (it never occurs in an encoded text)."""
    saved = D.train_bpe(["the cat sat on the mat"] * 20)
    saved.pad_token = None
    saved.save_pretrained(tmp_path / "tok")
    tokenizer = D.load_pretrained_tokenizer(str(tmp_path / "tok"))
    assert tokenizer.pad_token == D.EOS_TOKEN and tokenizer.padding_side == "right"


def test_pad_never_appears_inside_texts(tmp_path):
    examples = D.Examples(["a <|pad|> and <|endoftext|> inside"], ["\x00 <|pad|>"], [1])
    for tokenizer in (D.train_bpe(examples.premise * 10), D.byte_tokenizer()):
        tensors = D.tokenize_examples(tokenizer, examples, 40)
        mask = tensors["attention_mask"][0].bool()
        assert not (tensors["input_ids"][0][mask] == tokenizer.pad_token_id).any()
        assert (tensors["input_ids"][0][~mask] == tokenizer.pad_token_id).all()


def test_byte_tokenizer_is_utf8_bytes():
    tokenizer = D.byte_tokenizer()
    text = "héllo \n!"
    assert tokenizer(text)["input_ids"] == list(text.encode("utf-8"))
    assert tokenizer.pad_token_id == 256 and len(tokenizer) == 257
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_truncation_cuts_the_premise_and_keeps_the_hypothesis():
    tokenizer = D.byte_tokenizer()
    examples = D.Examples(["p" * 100], ["hypo"], [0])
    ids = D.tokenize_examples(tokenizer, examples, 16)["input_ids"][0].tolist()
    assert bytes(ids).decode() == "p" * 11 + "\nhypo"          # separator and hypothesis survive


# --------------------------------------------------------------------------- HF MNLI (network-free parts)

def test_mnli_offline_fails_fast_with_a_clear_message(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub.constants
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "empty_datasets_cache")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty_hub_cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(ValueError, match="dataset=mnli: cannot load nyu-mll/glue/mnli: offline mode.*synthetic"):
        D.prepare_data(config("mnli"), tmp_path / "cache")
    assert time.perf_counter() - start < 30


def test_mnli_rows_share_the_filter_and_cap_path(tmp_path, monkeypatch):
    """Everything after load_dataset runs on a local DatasetDict shaped like nyu-mll/glue mnli."""
    import datasets

    def split(n, offset):
        return datasets.Dataset.from_dict({
            "premise": [f"glue premise {offset + i}" for i in range(n)],
            "hypothesis": [f"glue hypothesis {offset + i}" for i in range(n)],
            "label": [[0, 1, 2, -1][i % 4] for i in range(n)],
            "idx": list(range(n))})

    fake = datasets.DatasetDict({"train": split(80, 0), "validation_matched": split(20, 1000),
                                 "validation_mismatched": split(20, 2000), "test_matched": split(8, 3000),
                                 "test_mismatched": split(8, 4000)})
    asked = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kw: asked.append(args) or fake)
    full = D.load_examples(config("mnli"))
    assert asked == [D.HF_MNLI]
    assert full["train"].label == [y for y in [0, 1, 2, -1] * 20 if y != -1]
    capped = D.load_examples(config("mnli", max_train_samples=12, max_eval_samples=4))
    assert len(capped["train"]) == 12 and len(capped["validation_mismatched"]) == 4
    assert set(capped["train"].premise) <= set(full["train"].premise)
    assert capped["train"].premise == D.load_examples(config("mnli", max_train_samples=12,
                                                             max_eval_samples=4))["train"].premise
    prepared = D.prepare_data(config("mnli", max_train_samples=12, max_eval_samples=4), tmp_path)
    assert prepared.name == "MNLI (nyu-mll/glue)" and prepared.splits["train"]["labels"].max() <= 2


# --------------------------------------------------------------------------- synthetic task

def test_synthetic_is_deterministic_by_seed_and_balanced():
    a = D.synthetic_examples("train", 300, seed=3)
    b = D.synthetic_examples("train", 300, seed=3)
    c = D.synthetic_examples("train", 300, seed=4)
    assert (a.premise, a.hypothesis, a.label) == (b.premise, b.hypothesis, b.label)
    assert a.premise != c.premise
    assert [a.label.count(k) for k in range(3)] == [100, 100, 100]
    longer = D.synthetic_examples("train", 600, seed=3)
    assert longer.premise[:300] == a.premise                   # a cap is a prefix of the full split


def test_synthetic_splits_differ_in_sentence_frames():
    slots = {**{w: "NAME" for w in D.synthetic._SYN_NAMES}, **{w: "PLACE" for w in D.synthetic._SYN_PLACES},
             **{w: "N" for w in D.synthetic._SYN_COUNT_WORDS}, **{w: "TOL" for w in D.synthetic._SYN_TOLERANCE},
             **{t: "THING" for t in D.synthetic._SYN_THINGS}, **{t + "s": "THING" for t in D.synthetic._SYN_THINGS}}

    def frames(split):
        examples = D.synthetic_examples(split, 600, seed=0)
        return {re.sub(r"\w+", lambda m: slots.get(m.group(), m.group()), p) for p in examples.premise}

    train = frames("train")
    assert len(train) == 4 and frames("validation_matched") == train
    assert len(frames("validation_mismatched")) == 2 and not frames("validation_mismatched") & train


WORD_VALUES = {w: i + 1 for i, w in enumerate(("one", "two", "three", "four", "five", "six", "seven", "eight",
                                                "nine", "ten", "eleven", "twelve"))}


def semantic_label(premise: str, hypothesis: str) -> int:
    """The label recomputed from the text by brute force over possible counts (independent of data.py)."""
    tolerance, count = re.search(r"\b(exactly|about|roughly) (\w+)", premise).groups()
    width = {"exactly": 0, "about": 1, "roughly": 2}[tolerance]
    allowed = set(range(WORD_VALUES[count] - width, WORD_VALUES[count] + width + 1))
    relation, bound = re.search(r"(more than|at least) (\d+)", hypothesis).groups()
    claimed = {x for x in range(-10, 40) if (x > int(bound) if relation == "more than" else x >= int(bound))}
    return 0 if allowed <= claimed else 2 if not allowed & claimed else 1


def test_synthetic_labels_follow_from_the_text():
    for split in D.SPLITS:
        examples = D.synthetic_examples(split, 400, seed=1)
        assert [semantic_label(p, h) for p, h in zip(examples.premise, examples.hypothesis)] == examples.label


def test_synthetic_needs_both_sentences():
    cues = D.synthetic_cue_accuracy()
    assert max(cues.values()) < 0.65
    # measured on samples too: guess the majority label per premise-side / hypothesis-side key
    examples = D.synthetic_examples("train", 30_000, seed=0)
    for side in (lambda p, h: re.search(r"(exactly|about|roughly) \w+", p).group(),
                 lambda p, h: re.search(r"(more than|at least) \d+", h).group()):
        votes = {}
        for p, h, y in zip(examples.premise, examples.hypothesis, examples.label):
            votes.setdefault(side(p, h), [0, 0, 0])[y] += 1
        assert sum(max(v) for v in votes.values()) / len(examples) < 0.65


def test_synthetic_prepared_and_named(tmp_path):
    prepared = D.prepare_data(config("synthetic", max_train_samples=90, max_eval_samples=30), tmp_path)
    assert prepared.name == "synthetic-nli (synthetic, not MNLI)" == D.display_name("synthetic")
    assert [len(prepared.splits[s]["labels"]) for s in D.SPLITS] == [90, 30, 30]
    assert prepared.info["label_counts"]["train"] == [30, 30, 30]
    assert prepared.info["at_max_length"]["train"] == 0


@pytest.fixture
def one_torch_thread():
    """Small models train faster on one thread, and it spares a machine shared with other tests."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_synthetic_is_learnable_quickly(tmp_path, one_torch_thread):
    """A tiny GPT-2 learns well above chance (33%) in 250 steps, ~15 s on one CPU thread. The slower
    >= 85% check is benchmarks/check_synthetic_learnable.py."""
    from transformers import GPT2Config, GPT2ForSequenceClassification
    torch.manual_seed(0)
    prepared = D.prepare_data(config("synthetic", max_length=24, max_train_samples=4800, max_eval_samples=300),
                              tmp_path)
    assert prepared.info["at_max_length"] == {s: 0 for s in D.SPLITS}      # nothing truncated at 24
    model = GPT2ForSequenceClassification(GPT2Config(
        n_layer=2, n_head=4, n_embd=128, n_positions=24, vocab_size=prepared.vocab_size, num_labels=3,
        pad_token_id=prepared.pad_token_id, bos_token_id=prepared.tokenizer.eos_token_id,
        eos_token_id=prepared.tokenizer.eos_token_id))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = D.train_batches(prepared, 32, seed=0)
    for _ in range(250):
        loss = model(**next(batches)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    correct = 0
    with torch.no_grad():
        for batch in D.eval_batches(prepared.splits["validation_matched"], 100):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            correct += int((logits.argmax(-1) == batch["labels"]).sum())
    assert correct / 300 >= 0.6, f"accuracy {correct / 300:.2f} after 250 steps"


# --------------------------------------------------------------------------- batches

def toy_split(n):
    return {"input_ids": torch.arange(n).unsqueeze(1).repeat(1, 3), "attention_mask": torch.ones(n, 3, dtype=torch.long),
            "labels": torch.arange(n) % 3}


def take(iterator, k):
    return [next(iterator) for _ in range(k)]


def test_train_batches_resume_exactly():
    split = toy_split(10)
    straight = take(D.train_batches(split, 4, seed=7), 12)
    for start in (0, 1, 2, 5, 9):
        resumed = take(D.train_batches(split, 4, seed=7, start_step=start), 12 - start)
        for a, b in zip(straight[start:], resumed):
            assert all(torch.equal(a[k], b[k]) for k in a)


def test_train_batches_cover_each_epoch_and_reshuffle():
    split = toy_split(12)
    batches = take(D.train_batches(split, 4, seed=1), 6)               # two epochs of three batches
    epochs = [torch.cat([b["input_ids"][:, 0] for b in batches[i:i + 3]]) for i in (0, 3)]
    assert all(sorted(e.tolist()) == list(range(12)) for e in epochs)
    assert not torch.equal(epochs[0], epochs[1])
    other = torch.cat([b["input_ids"][:, 0] for b in take(D.train_batches(split, 4, seed=2), 3)])
    assert not torch.equal(epochs[0], other)
    assert all(b["labels"].tolist() == (b["input_ids"][:, 0] % 3).tolist() for b in batches)   # rows stay aligned


def test_train_batches_are_full_even_when_data_is_small():
    batches = take(D.train_batches(toy_split(3), 8, seed=0), 3)
    assert all(len(b["labels"]) == 8 for b in batches)


def test_eval_batches_in_order_and_complete():
    split = toy_split(10)
    batches = list(D.eval_batches(split, 4))
    assert [len(b["labels"]) for b in batches] == [4, 4, 2]
    assert torch.equal(torch.cat([b["input_ids"] for b in batches]), split["input_ids"])


def test_display_names():
    assert D.display_name("synthetic") == "synthetic-nli (synthetic, not MNLI)"
    assert "MNLI" in D.display_name("mnli")
    assert D.display_name("data/mnli") == "data/mnli (local MNLI-format files)"
