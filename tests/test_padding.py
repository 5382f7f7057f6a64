"""Dynamic padding: storage and batches follow the real lengths, predictions do not change,
tokens/s counts real tokens, and a max_length the model cannot embed is refused up front."""

import pytest
import torch
from transformers import GPT2Config, GPT2ForSequenceClassification

from lossysim import data as D
from lossysim.cli import main
from lossysim.config import ExperimentConfig
from lossysim.io import read_jsonl
from lossysim.models import NAMED_MAX_POSITIONS, check_max_length
from lossysim.run.experiment import run_experiment


pytestmark = pytest.mark.usefixtures("private_cache")


def ragged_split(lengths, pad=0):
    """Rows 1..L (never the pad id) right-padded to the longest; labels = row index."""
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.arange(1, n + 1) + 100 * i
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.arange(len(lengths))}


LENGTHS = [3, 17, 5, 40, 2, 9, 11, 4, 6, 30, 8, 1]


def test_train_and_eval_batches_are_as_wide_as_their_longest_row():
    split = ragged_split(LENGTHS)
    full_lengths = split["attention_mask"].sum(1)
    seen = []
    batches = D.train_batches(split, 4, seed=3)
    for _ in range(9):
        batch = next(batches)
        rows = batch["labels"]
        assert batch["input_ids"].shape[1] == int(full_lengths[rows].max())
        assert batch["input_ids"].is_contiguous()
        # every row keeps all of its tokens, nothing else
        assert torch.equal(batch["attention_mask"].sum(1), full_lengths[rows])
        for row, ids in zip(rows, batch["input_ids"]):
            n = int(full_lengths[row])
            assert torch.equal(ids[:n], split["input_ids"][row, :n])
        seen.append(batch["input_ids"].shape[1])
    assert min(seen) < max(LENGTHS)                      # some batch really is narrower
    for batch in D.eval_batches(split, 5):
        assert batch["input_ids"].shape[1] == int(batch["attention_mask"].sum(1).max())


def test_storage_follows_real_lengths_not_max_length(tmp_path):
    small = D.prepare_data(ExperimentConfig(dataset="synthetic", max_length=64, max_train_samples=300,
                                            max_eval_samples=60), tmp_path)
    huge = D.prepare_data(ExperimentConfig(dataset="synthetic", max_length=100_000, max_train_samples=300,
                                           max_eval_samples=60), tmp_path)
    for split in D.SPLITS:
        lengths = small.splits[split]["attention_mask"].sum(1)
        assert small.splits[split]["input_ids"].shape[1] == int(lengths.max()) < 64
        # nothing is truncated at 64, so a huge max_length stores the very same tensors
        for key in ("input_ids", "attention_mask", "labels"):
            assert torch.equal(small.splits[split][key], huge.splits[split][key])
        assert small.info["mean_tokens"][split] == pytest.approx(float(lengths.float().mean()))
    assert huge.info["at_max_length"] == {s: 0 for s in D.SPLITS}


def test_cut_batches_predict_what_padded_batches_predict():
    torch.manual_seed(0)
    model = GPT2ForSequenceClassification(GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=64,
                                                     vocab_size=5000, num_labels=3, pad_token_id=0)).eval()
    split = ragged_split(LENGTHS)
    padded = {k: torch.nn.functional.pad(v, (0, 64 - v.shape[1])) if v.dim() == 2 else v
              for k, v in split.items()}
    with torch.no_grad():
        wide = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits
        cut = torch.cat([model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
                         for b in D.eval_batches(padded, 4)])
    torch.testing.assert_close(cut, wide, rtol=1e-5, atol=1e-5)


def test_tokens_per_s_counts_real_tokens(tmp_path):
    config = ExperimentConfig(model="tiny", dataset="synthetic", max_length=128, max_train_samples=64,
                              max_eval_samples=32, batch_size=8, eval_batch_size=32, steps=6, eval_every=6,
                              log_every=3, warmup_steps=1, dropout=0.0, out=str(tmp_path / "run")).validate()
    summary = run_experiment(config, config.out, progress=False)
    assert summary["status"] == "completed", summary.get("error")
    data = D.prepare_data(config, tmp_path / "cache-check")
    batches = D.train_batches(data, 8, seed=0)
    real = [int(next(batches)["attention_mask"].sum()) for _ in range(6)]
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["split"] == "train"]
    assert [r["tokens"] for r in rows] == [sum(real[:3]), sum(real[3:])]
    assert sum(real) < 6 * 8 * 32                          # far below batch x max_length (128)


def test_max_length_beyond_the_models_positions_is_one_line(tmp_path, capsys):
    code = main(["train", "--no-progress", "--out", str(tmp_path / "r"), "--set", "max_length=100000"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "max_length=100000" in err and str(NAMED_MAX_POSITIONS) in err
    assert not (tmp_path / "r").exists()                 # bad settings write nothing
    check_max_length("tiny", NAMED_MAX_POSITIONS)        # the limit itself is allowed


def test_pretrained_model_positions_are_read_from_its_config(tmp_path):
    GPT2Config(n_positions=48, n_embd=32, n_layer=1, n_head=2).save_pretrained(tmp_path / "m")
    check_max_length(str(tmp_path / "m"), 48)
    with pytest.raises(ValueError, match=r"max_length=49 .*48 positions"):
        check_max_length(str(tmp_path / "m"), 49)
