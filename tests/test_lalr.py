"""LALR (seeds/000): the metrics of sections 2.1-2.4 / B.1.4 against hand computations, the
per-layer update against scheduled LR x multiplier in every phase and mode, the phase cycle
across resume, composition with TempBalance, and MiniLM full / LoRA fine-tuning offline."""

from __future__ import annotations

import math
import random
from functools import partial

import lightning.pytorch as pl
import numpy as np
import pandas as pd
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader

from lalr_lightning.callbacks.lalr import LALRScheduleCallback
from lalr_lightning.callbacks.tempbalance import TempBalanceCallback
from lalr_lightning.core.spectral.lalr_metrics import lalr_layers, lalr_metrics, lalr_multipliers, minmax
from tests._dist import ddp_spawn
from tests._oracles import ShadowOracle
from tests._toys import MemLogger, ToyMLP, make_trainer

EPS = 1e-12


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # the CI box has 2 cores shared by many processes; OpenMP spin-waiting across 2 threads
    # makes small LAPACK calls 10-30x slower there
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


_trainer = partial(make_trainer, max_epochs=3)


# ----------------------------------------------------------------------------- hand computation


class Toy(nn.Module):
    """Three (5, 6) Linear, two (3, 5) Linear, a lone Embedding (4, 6) and a lone Conv2d."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b, self.c = nn.Linear(6, 5), nn.Linear(6, 5), nn.Linear(6, 5)
        self.d, self.e = nn.Linear(5, 3), nn.Linear(5, 3)
        self.emb = nn.Embedding(4, 6)
        self.conv = nn.Conv2d(2, 3, 2)  # (3, 2, 2, 2) -> the 3 x 8 matrix for the SVD


def hand_mean_sv(w: np.ndarray) -> float:
    """B.1.4: mean of the r = rank(W) nonzero singular values; convs as out x (in k k)."""
    m = w.reshape(w.shape[0], -1)
    s = np.linalg.svd(m, compute_uv=False)
    s = s[s > s[0] * max(m.shape) * np.finfo(np.float32).eps] if s[0] > 0 else s[:0]
    return float(s.mean()) if len(s) else 0.0


def hand_p(w: np.ndarray) -> np.ndarray:
    a = np.abs(w.ravel())
    return a / a.sum() if a.sum() > 0 else np.full(a.size, 1.0 / a.size)


def hand_ce(p: np.ndarray, q: np.ndarray) -> float:
    return float(-np.sum(p * np.log(q + EPS)))


def hand_cos(u: np.ndarray, v: np.ndarray) -> float:
    nu, nv = np.linalg.norm(u), np.linalg.norm(v)
    return 0.0 if nu == 0 or nv == 0 else float(u @ v / (nu * nv))


def hand_group(ws: list[np.ndarray]) -> tuple[list[float], list[float]]:
    """raw_ce (mean CE to the others minus ln n) and raw_cs (mean cosine) within one group."""
    g, n = len(ws), ws[0].size
    ps = [hand_p(w) for w in ws]
    ce, cs = [], []
    for i in range(g):
        ce.append(sum(hand_ce(ps[i], ps[j]) for j in range(g) if j != i) / (g - 1) - math.log(n))
        cs.append(sum(hand_cos(ws[i].ravel(), ws[j].ravel()) for j in range(g) if j != i) / (g - 1))
    return ce, cs


def hand_minmax(x):
    x = np.asarray(x, dtype=np.float64)
    return (x - x.min()) / (x.max() - x.min())


def _np_weights(model):
    return {la.name: la.weight.detach().double().numpy() for la in lalr_layers(model)}


def test_metrics_equal_hand_computation_shape_groups():
    model = Toy()
    w = _np_weights(model)
    assert list(w) == ["a", "b", "c", "d", "e", "emb", "conv"]
    df = lalr_metrics(model).set_index("name")
    raw_svd = [hand_mean_sv(w[n]) for n in w]
    ce_abc, cs_abc = hand_group([w["a"], w["b"], w["c"]])
    ce_de, cs_de = hand_group([w["d"], w["e"]])
    raw_ce = ce_abc + ce_de + [np.nan, np.nan]  # emb and conv have no same-shaped peer
    raw_cs = cs_abc + cs_de + [np.nan, np.nan]
    np.testing.assert_allclose(df["raw_svd"], raw_svd, rtol=1e-9)
    np.testing.assert_allclose(df["raw_ce"], raw_ce, rtol=1e-9)
    np.testing.assert_allclose(df["raw_cs"], raw_cs, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(df["svd"], 1 - hand_minmax(raw_svd), atol=1e-9)
    np.testing.assert_allclose(df["ce"], list(1 - hand_minmax(raw_ce[:5])) + [0.5, 0.5], atol=1e-9)
    np.testing.assert_allclose(df["cs"], list(hand_minmax(raw_cs[:5])) + [0.5, 0.5], atol=1e-9)
    assert df["peers"].tolist() == [2, 2, 2, 1, 1, 0, 0]
    assert df.loc["conv", "shape"] == "3x2x2x2" and df.loc["emb", "kind"] == "embedding"
    # the paper's CE value is raw_ce + ln(n)
    pa, pb, pc = (hand_p(w[n]) for n in "abc")
    assert df.loc["a", "raw_ce"] + math.log(30) == pytest.approx((hand_ce(pa, pb) + hand_ce(pa, pc)) / 2, rel=1e-9)


def test_metrics_equal_hand_computation_histogram():
    model = Toy(seed=3)
    w = _np_weights(model)
    bins, top = 8, 3.0
    df = lalr_metrics(model, groups="histogram", bins=bins, hist_range=top)
    hists = []
    for x in w.values():
        a = np.abs(x.ravel())
        v = np.minimum(a / a.mean(), top)  # |w| / mean|w|, everything above the range in the last bin
        hists.append(np.histogram(v, bins=bins, range=(0.0, top))[0] / a.size)
    L = len(hists)
    raw_ce = [sum(hand_ce(hists[i], hists[j]) for j in range(L) if j != i) / (L - 1) - math.log(bins) for i in range(L)]
    raw_cs = [sum(hand_cos(hists[i], hists[j]) for j in range(L) if j != i) / (L - 1) for i in range(L)]
    np.testing.assert_allclose(df["raw_ce"], raw_ce, rtol=1e-9)
    np.testing.assert_allclose(df["raw_cs"], raw_cs, rtol=1e-9)
    np.testing.assert_allclose(df["ce"], 1 - hand_minmax(raw_ce), atol=1e-9)
    np.testing.assert_allclose(df["cs"], hand_minmax(raw_cs), atol=1e-9)
    assert (df["peers"] == L - 1).all()


def test_constant_metrics_and_zero_weights():
    # two identical layers: every raw metric is equal -> zero range -> every final metric is 1
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with torch.no_grad():
        model[1].weight.copy_(model[0].weight)
    df = lalr_metrics(model)
    assert df[["svd", "ce", "cs"]].to_numpy().tolist() == [[1.0, 1.0, 1.0]] * 2
    np.testing.assert_array_equal(minmax([2.0, 2.0]), [1.0, 1.0])
    np.testing.assert_array_equal(minmax([2.0, 2.0], flip=True), [1.0, 1.0])
    np.testing.assert_array_equal(minmax([1.0, np.nan, 3.0]), [0.0, np.nan, 1.0])

    # an all-zero layer: rank 0 -> raw_svd 0; uniform distribution for CE; cosine 0
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(4, 3), nn.Linear(4, 3))
    with torch.no_grad():
        model[1].weight.zero_()
    w = [m.weight.detach().double().numpy() for m in model]
    df = lalr_metrics(model)
    ce, cs = hand_group(w)
    assert df["raw_svd"][1] == 0.0
    np.testing.assert_allclose(df["raw_ce"], ce, rtol=1e-9)
    np.testing.assert_allclose(df["raw_cs"], cs, rtol=1e-9, atol=1e-12)
    uniform = np.full(12, 1 / 12)
    assert df["raw_ce"][1] == pytest.approx((hand_ce(uniform, hand_p(w[0])) + hand_ce(uniform, hand_p(w[2]))) / 2
                                            - math.log(12), rel=1e-9)
    assert df["raw_cs"][1] == 0.0
    assert not df.isna().any().any()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_weights_name_the_layer(bad):
    model = Toy()
    with torch.no_grad():
        model.d.weight[1, 2] = bad
    with pytest.raises(ValueError, match=r"layer 'd' has (NaN|Inf) weights"):
        lalr_metrics(model)


def test_one_layer_and_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="at least 2 weight matrices.*only 'only'"):
        lalr_metrics(nn.ModuleDict({"only": nn.Linear(3, 3)}))
    with pytest.raises(ValueError, match="valid: svd, ce, cs"):
        LALRScheduleCallback(phases=("svd", "gradnorm"))
    with pytest.raises(ValueError, match="valid: sequential, weighted, hessian"):
        LALRScheduleCallback(mode="newton")
    with pytest.raises(ValueError, match="valid: shape, histogram"):
        LALRScheduleCallback(groups="size")
    with pytest.raises(ValueError, match="only apply to mode='weighted'"):
        LALRScheduleCallback(weights={"ce": 1.0})
    with pytest.raises(ValueError, match="unknown metric names in weights"):
        LALRScheduleCallback(mode="weighted", weights={"svd": 1.0, "snr": 1.0})
    with pytest.raises(ValueError, match="floor must be in"):
        LALRScheduleCallback(floor=1.5)
    # a model without two eligible layers fails at setup, naming the fix
    with pytest.raises(ValueError, match="Widen layer_types"):
        _trainer([LALRScheduleCallback(layer_types=("embedding",))], max_epochs=1).fit(ToyMLP())


def test_multiplier_formulas():
    df = pd.DataFrame({"name": ["a", "b", "c"], "svd": [1.0, 0.5, 0.0], "ce": [0.0, 1.0, 0.5], "cs": [0.0, 0.5, 1.0]})
    m = lalr_multipliers(df, mode="sequential", phase="ce", floor=0.1)
    assert m == pytest.approx({"a": 0.1, "b": 1.0, "c": 0.1 + 0.9 * 0.5})
    m = lalr_multipliers(df, mode="weighted", weights={"svd": 2.0, "cs": 1.0}, floor=0.0)
    assert m == pytest.approx({"a": 2 / 3, "b": (2 * 0.5 + 0.5) / 3, "c": 1 / 3})
    # B.4.5.3 with both factors mapped onto [0.1, 1]: g = a e^ce c, f = min g / g
    g = np.array([0.1 * 1.0 * 0.1, 0.55 * math.e * 0.55, 1.0 * math.exp(0.5) * 1.0])
    m = lalr_multipliers(df, mode="hessian", hessian_delta=0.1, floor=0.0)
    assert list(m.values()) == pytest.approx(list(g.min() / g))
    assert max(m.values()) == 1.0
    m = lalr_multipliers(df, mode="hessian", floor=0.2)
    assert list(m.values()) == pytest.approx(list(0.2 + 0.8 * g.min() / g))


# ----------------------------------------------------------------------------- training


class ExpectFromMetrics(Callback):
    """Runs after LALR at each epoch start: recomputes the metrics independently, derives the
    multipliers by hand from the paper's formulas and hands them to the ShadowOracle, which then
    checks every update against scheduled LR x multiplier."""

    def __init__(self, lalr: LALRScheduleCallback, oracle: ShadowOracle, others=()):
        self.lalr, self.oracle, self.others = lalr, oracle, others
        self.phases: list[str] = []

    def expected(self, pl_module, epoch):
        cb = self.lalr
        df = lalr_metrics(pl_module, groups=cb.groups).set_index("name")
        f, fl = None, cb.floor
        if cb.mode == "sequential":
            phase = cb.phases[epoch % len(cb.phases)]
            f = df[phase]
        elif cb.mode == "weighted":
            w = cb.weights
            f = (w["svd"] * df["svd"] + w["ce"] * df["ce"] + w["cs"] * df["cs"]) / sum(w.values())
        else:
            d = cb.hessian_delta
            g = (d + (1 - d) * (1 - df["svd"])) * np.exp(df["ce"]) * (d + (1 - d) * df["cs"])
            f = g.min() / g
        return {n: fl + (1 - fl) * float(v) for n, v in f.items()}

    def on_train_epoch_start(self, trainer, pl_module):
        want = self.expected(pl_module, trainer.current_epoch)
        assert self.lalr.multipliers == pytest.approx(want, rel=1e-9)
        self.phases.append(self.lalr.phase)
        total = dict(want)
        for other in self.others:  # composed callbacks multiply
            for k, v in other.multipliers.items():
                total[k] = total.get(k, 1.0) * v
        self.oracle.expected = total


@pytest.mark.parametrize("kw, phases", [
    (dict(groups="histogram"), ["svd", "ce", "cs"]),
    (dict(groups="histogram", floor=0.0, phases=("cs", "svd")), ["cs", "svd", "cs"]),
    (dict(groups="shape"), ["svd", "ce", "cs"]),
    (dict(groups="histogram", mode="weighted", weights={"svd": 1.0, "ce": 2.0, "cs": 0.5}), ["weighted"] * 3),
    (dict(groups="histogram", mode="hessian"), ["hessian"] * 3),
])
def test_update_is_scheduled_lr_times_phase_metric(kw, phases):
    lalr = LALRScheduleCallback(**kw)
    oracle = ShadowOracle()
    check = ExpectFromMetrics(lalr, oracle)
    _trainer([lalr, check, oracle]).fit(ToyMLP(opt="adamw", sched="step"))
    assert check.phases == phases
    assert oracle.steps == 3 * 8 and oracle.expected is not None
    assert [h["phase"] for h in lalr.history] == phases
    assert set(lalr.metrics["name"]) == {"net.0", "net.2", "net.4", "net.6"}
    if kw["groups"] == "histogram" and "mode" not in kw:  # min-max gives 0 to one layer: the floor
        assert min(lalr.multipliers.values()) == pytest.approx(kw.get("floor", 0.1), abs=1e-12)


def test_phase_cycle_and_multipliers_survive_resume(tmp_path):
    def fit(max_epochs, dirpath=None, ckpt=None):
        cb = LALRScheduleCallback(groups="histogram")
        cbs = [cb] + ([ModelCheckpoint(dirpath=dirpath, save_last=True)] if dirpath else [])
        _trainer(cbs, max_epochs=max_epochs, enable_checkpointing=dirpath is not None).fit(
            ToyMLP(opt="adamw", sched="step"), ckpt_path=ckpt)
        return cb

    full = fit(5)
    fit(2, dirpath=tmp_path)
    ckpt = tmp_path / "last.ckpt"
    state = torch.load(ckpt, weights_only=True)["callbacks"]["LALRScheduleCallback"]  # plain containers
    assert state["position"] == 2 and state["last_epoch"] == 1 and state["phase"] == "ce"
    resumed = fit(5, dirpath=tmp_path / "resumed", ckpt=str(ckpt))
    assert [h["phase"] for h in resumed.history] == [h["phase"] for h in full.history] == \
        ["svd", "ce", "cs", "svd", "ce"]
    for a, b in zip(resumed.history, full.history):
        assert a["epoch"] == b["epoch"]
        assert a["multipliers"] == pytest.approx(b["multipliers"], rel=1e-6)
    assert resumed.multipliers == pytest.approx(full.multipliers, rel=1e-6)


def test_composes_with_tempbalance(monkeypatch):
    from lalr_lightning import viz

    figures = []
    monkeypatch.setattr(viz, "log_figure", lambda trainer, key, fig, *a, **k: figures.append(key) or 0)
    tb = TempBalanceCallback(figures="first_last")  # the heatmaps at fit end
    lalr = LALRScheduleCallback(groups="histogram", figures="first_last")
    oracle = ShadowOracle()
    check = ExpectFromMetrics(lalr, oracle, others=(tb,))
    _trainer([tb, lalr, check, oracle], max_epochs=2, logger=MemLogger()).fit(ToyMLP(opt="sgd", sched="cosine"))
    assert set(tb.multipliers) == {"net.2", "net.4"}
    assert oracle.expected["net.2"] == pytest.approx(lalr.multipliers["net.2"] * tb.multipliers["net.2"])
    assert oracle.steps == 2 * 8
    assert "lalr/multipliers" in figures and "tempbalance/multipliers" in figures


# ----------------------------------------------------------------------------- MiniLM, offline

_POS = ["good", "great", "wonderful", "lovely", "excellent", "fun"]
_NEG = ["bad", "awful", "boring", "terrible", "dull", "poor"]


def _text_loader(tokenizer, n: int = 24, batch_size: int = 8) -> DataLoader:
    rng = random.Random(0)
    rows = []
    for i in range(n):
        label = i % 2
        word = rng.choice(_POS if label else _NEG)
        rows.append((f"the film was {word} and the cast was {rng.choice(_POS + _NEG)}", label))

    def collate(batch):
        enc = tokenizer([t for t, _ in batch], padding=True, return_tensors="pt")
        enc["labels"] = torch.tensor([y for _, y in batch])
        return dict(enc)

    return DataLoader(rows, batch_size=batch_size, collate_fn=collate)


class RecordExpected(Callback):
    """After LALR at each epoch start: lalr_metrics of the model's trainable layers, as a user
    would call it, and the multipliers of the epoch's phase by the paper's formula."""

    def __init__(self, lalr):
        self.lalr = lalr
        self.per_epoch: list[tuple[pd.DataFrame, dict[str, float]]] = []

    def on_train_epoch_start(self, trainer, pl_module):
        df = lalr_metrics(pl_module, trainable_only=True)
        phase = self.lalr.phases[trainer.current_epoch % 3]
        self.per_epoch.append((df, {n: 0.1 + 0.9 * v for n, v in zip(df["name"], df[phase])}))


@pytest.mark.parametrize("lora", [False, True])
def test_minilm_full_and_lora_logged_multipliers_equal_metrics(lora, tmp_path):
    pytest.importorskip("transformers")
    if lora:
        pytest.importorskip("peft")
    text = pytest.importorskip("lalr_lightning.models.text")
    from transformers import AutoTokenizer

    from lalr_lightning.text_assets import minilm_path

    try:
        path = minilm_path()
    except (ImportError, FileNotFoundError) as e:
        pytest.skip(str(e))
    model = text.TextClassifier(model_name="minilm-l6", lora=lora)
    loader = _text_loader(AutoTokenizer.from_pretrained(path, local_files_only=True))
    lalr = LALRScheduleCallback()
    rec = RecordExpected(lalr)
    epochs = 2 if lora else 1  # LoRA: the second epoch measures merged weights with B != 0
    _trainer([lalr, rec], max_epochs=epochs, limit_train_batches=2, logger=CSVLogger(tmp_path, name="lalr")).fit(
        model, train_dataloaders=loader)

    names = list(rec.per_epoch[0][0]["name"])
    bert = "model.base_model.model.bert." if lora else "model.bert."
    if lora:
        # LoRA-wrapped projections are single layers (merged weight); frozen matrices are left out
        assert f"{bert}encoder.layer.0.attention.self.query" in names
        assert f"{bert}encoder.layer.0.attention.self.value" in names
        assert not any("lora_" in n or "base_layer" in n or n.endswith(".key") for n in names)
        assert len(names) == 13  # 6 blocks x (query, value) + the classifier head
    else:
        assert len(names) == 41 and names[0] == f"{bert}embeddings.word_embeddings"

    logged = pd.read_csv(tmp_path / "lalr" / "version_0" / "metrics.csv")
    rows = logged[logged["lalr/phase"].notna()].reset_index(drop=True)
    assert rows["lalr/phase"].tolist() == [0.0, 1.0][:epochs]
    for e, (df, want) in enumerate(rec.per_epoch):
        for n in names:
            assert rows.loc[e, f"lalr/multiplier/{n}"] == pytest.approx(want[n], rel=1e-6), n
        for metric in ("svd", "ce", "cs"):
            got = rows.loc[e, [f"lalr/{metric}/{n}" for n in names]].to_numpy(dtype=float)
            np.testing.assert_allclose(got, df[metric].to_numpy(), rtol=1e-6, atol=1e-9)
    assert lalr.multipliers == pytest.approx(rec.per_epoch[-1][1], rel=1e-9)

    if lora:
        # the measured weight of a LoRA layer is W + scaling * B A, and B has moved from 0
        q = model.model.base_model.model.bert.encoder.layer[0].attention.self.query
        b = q.lora_B["default"].weight.detach().double()
        assert b.abs().max() > 0
        merged = q.base_layer.weight.detach().double() + q.scaling["default"] * b @ q.lora_A["default"].weight.detach().double()
        df = lalr_metrics(model, trainable_only=True).set_index("name")
        assert df.loc[f"{bert}encoder.layer.0.attention.self.query", "raw_svd"] == pytest.approx(
            hand_mean_sv(merged.numpy()), rel=1e-7)


class LALRSameOnEveryRank(Callback):
    """Inside each rank: the phase and the multipliers are the same on both ranks, and the
    controller holds them."""

    def on_train_epoch_end(self, trainer, pl_module):
        cb = next(c for c in trainer.callbacks if isinstance(c, LALRScheduleCallback))
        mine = torch.tensor([cb.multipliers[k] for k in sorted(cb.multipliers)], dtype=torch.float64)
        every = trainer.strategy.all_gather(mine)
        assert every.shape[0] == 2 and torch.equal(every[0], every[1]), every
        phases = trainer.strategy.all_gather(torch.tensor(["svd", "ce", "cs"].index(cb.phase)))
        assert phases[0] == phases[1]
        pl_module.log("lalr_ddp_checked", 1.0, sync_dist=True)


def test_ddp_ranks_agree_on_phase_and_multipliers():
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ddp_spawn(), max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[LALRScheduleCallback(), LALRSameOnEveryRank()])
    trainer.fit(ToyMLP(opt="adamw", sched="step"))
    assert trainer.callback_metrics["lalr_ddp_checked"] == 1.0
