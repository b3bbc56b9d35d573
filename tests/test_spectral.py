"""Spectral analysis: ESDs, power-law fits and HT-SR metrics against WeightWatcher, TempBalance's
formulas, the powerlaw package and hand computations; plus the figures."""

from __future__ import annotations

import logging
import math
import types
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from lalr_lightning.core.model.layers import matrix_layers
from lalr_lightning.core.spectral import esd, esd_metrics, htsr
from lalr_lightning.core.spectral.htsr import FITS, alphas, analyze, compute_esds, fit_power_law, layer_esd
from lalr_lightning.core.spectral.powerlaw import fit_layers

# columns WW reports with the same meaning
WW_FLOAT_COLS = ("alpha", "xmin", "xmax", "D", "sigma", "spectral_norm", "log_spectral_norm", "norm", "log_norm",
                 "stable_rank", "entropy", "alpha_weighted", "log_alpha_norm")
WW_INT_COLS = ("num_evals", "num_pl_spikes")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One BLAS/OpenMP thread: these are small SVDs, and on a shared CPU two spinning OpenMP
    threads per process can make them 10x slower."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover
        threadpool_limits = None
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    limits = threadpool_limits(1) if threadpool_limits else None
    yield
    torch.set_num_threads(old)
    if limits is not None:
        limits.restore_original_limits()


# --------------------------------------------------------------------------- references by hand


def ww_loop_fit(x: np.ndarray) -> tuple[float, float, float]:
    """WeightWatcher's standard fit written as its plain loop (xmin, alpha, D)."""
    x = np.sort(np.asarray(x, dtype=np.float64))
    N = len(x)
    lx = np.log(x)
    alphas_, Ds = np.zeros(N - 1), np.ones(N - 1)
    for i in range(N - 1):
        n = N - i
        a = 1 + n / (lx[i:].sum() - n * lx[i])
        alphas_[i] = a
        if a > 1:
            Ds[i] = np.abs(1 - (x[i:] / x[i]) ** (1 - a) - np.arange(n) / n).max()
    i = int(np.argmin(Ds))
    return x[i], alphas_[i], Ds[i]


def tb_peak_loop_fit(x: np.ndarray) -> tuple[float, float, float]:
    """TempBalance's ``xmin_peak`` loop (xmin, alpha, D)."""
    x = np.sort(np.asarray(x, dtype=np.float64))
    N = len(x)
    lx = np.log(x)
    h = np.log10(x)
    counts, edges = np.histogram(h, bins=100, range=(h.min(), h.max()))
    peak = 10 ** edges[np.argmax(counts)]
    lo, hi = np.log10(0.95 * peak), 1.5 * peak
    alphas_, Ds = np.zeros(N - 1), np.ones(N - 1)
    for i in range(N - 1):
        if x[i] < lo:
            continue
        if x[i] > hi:
            break
        n = N - i
        a = 1 + n / (lx[i:].sum() - n * lx[i])
        alphas_[i] = a
        if a > 1:
            Ds[i] = np.abs(1 - (x[i:] / x[i]) ** (1 - a) - np.arange(n) / n).max()
    i = int(np.argmin(Ds))
    return x[i], alphas_[i], Ds[i]


def pareto(n: int, a: float, seed: int, xmin: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return xmin * (1 - rng.random(n)) ** (-1 / (a - 1))


# --------------------------------------------------------------------------- WeightWatcher oracle


def _ww_table(model: nn.Module):
    ww = pytest.importorskip("weightwatcher")
    logging.getLogger("weightwatcher").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        df = ww.WeightWatcher(model=model).analyze(plot=False, randomize=False)
    return df.set_index("longname")


@pytest.fixture(scope="module", params=["resnet18", "vit_tiny_patch16_224"])
def ww_case(request):
    """One timm model at random init, WW's table, and ours in float32 and float64 (computed once)."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(request.param, pretrained=False).eval()
    ww_df = _ww_table(model)
    ours = {dt: analyze(model, dtype=dt).set_index("name") for dt in (torch.float32, torch.float64)}
    return request.param, model, ww_df, ours


def _compare(ours, ww_df, rtol):
    assert list(ours.index) == list(ww_df.index)  # same layers, same order, same names
    for col in WW_INT_COLS:
        np.testing.assert_array_equal(ours[col].to_numpy(int), ww_df[col].to_numpy(int), err_msg=col)
    for col in WW_FLOAT_COLS:
        np.testing.assert_allclose(ours[col].to_numpy(float), ww_df[col].to_numpy(float), rtol=rtol, atol=0,
                                   err_msg=col)


def test_ks_equals_weightwatcher_float64(ww_case):
    name, model, ww_df, ours = ww_case
    _compare(ours[torch.float64], ww_df, rtol=1e-9)
    kinds = set(ours[torch.float64]["kind"])
    assert kinds == ({"conv2d", "linear"})
    if name == "resnet18":  # 7x7 stem, 3x3, 1x1 downsample, fc
        shapes = {s[2:] for s in ours[torch.float64]["shape"] if len(s) == 4}
        assert shapes == {(7, 7), (3, 3), (1, 1)}
    else:  # 16x16 patch embedding
        assert ours[torch.float64].loc["patch_embed.proj", "shape"] == (192, 3, 16, 16)


def test_ks_equals_weightwatcher_float32(ww_case):
    _, _, ww_df, ours = ww_case
    _compare(ours[torch.float32], ww_df, rtol=1e-3)


def test_small_layers_and_small_n_rule_equal_weightwatcher():
    # an embedding with 16 eigenvalues (< 20: WW's small-sample rule), a linear with exactly 20,
    # a small conv (72 pooled eigenvalues) and a wide linear
    torch.manual_seed(1)
    model = nn.Sequential(nn.Embedding(100, 16), nn.Linear(20, 30), nn.Conv2d(8, 16, 3), nn.Linear(64, 48))
    ww_df = _ww_table(model)
    ours = analyze(model, dtype=torch.float64, min_evals=8).set_index("name")
    _compare(ours, ww_df, rtol=1e-9)
    assert ours.loc["0", "num_evals"] == 16 and ours.loc["2", "num_evals"] == 72


# --------------------------------------------------------------------------- fits


def test_median_fit_is_tempbalance_formula():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 30, generator=g, dtype=torch.float64)
    ev = np.sort(np.linalg.svd(w.numpy(), compute_uv=False) ** 2)
    N = len(ev)
    i = N // 2
    n = N - i
    alpha = 1 + n / (np.log(ev[i:]).sum() - n * np.log(ev[i]))
    D = np.abs(1 - (ev[i:] / ev[i]) ** (1 - alpha) - np.arange(n) / n).max()
    res = fit_power_law(torch.tensor(ev), "median")
    assert res["xmin"] == ev[i] and res["xmin_index"] == i
    assert res["alpha"] == pytest.approx(alpha, rel=1e-12)
    assert res["D"] == pytest.approx(D, rel=1e-12)
    assert res["num_pl_spikes"] == n
    layer = matrix_layers(nn.Sequential(nn.Linear(30, 40)))
    layer[0].module.weight.data = w.float()
    assert alphas(layer, dtype=torch.float64)["0"] == pytest.approx(alpha, rel=1e-6)
    # xmin_pos is TempBalance's divisor
    res3 = fit_power_law(torch.tensor(ev), "median", xmin_pos=3)
    assert res3["xmin_index"] == N // 3


def test_mle_equals_powerlaw_package_at_fixed_xmin():
    powerlaw = pytest.importorskip("powerlaw")
    data = pareto(800, 2.5, seed=0)
    xm = np.sort(data)[len(data) // 2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = powerlaw.Fit(data, xmin=xm, discrete=False, verbose=False)
        pl_alpha, pl_D = fit.power_law.alpha, fit.power_law.D
    ours = fit_power_law(torch.tensor(data), "median")
    assert ours["xmin"] == xm
    assert ours["alpha"] == pytest.approx(pl_alpha, rel=1e-10)
    assert ours["D"] == pytest.approx(pl_D, rel=1e-10)


def test_ks_fit_equals_powerlaw_package_search():
    # powerlaw.Fit tries the same candidates (every distinct value but the largest) with the same
    # one-sided KS distance; it refits alpha numerically outside (1.5, 3] (and caps it at 3 in
    # powerlaw 2.0), so we compare on a sample whose fitted alpha lies inside that range.
    powerlaw = pytest.importorskip("powerlaw")
    data = pareto(500, 2.5, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = powerlaw.Fit(data, discrete=False, verbose=False)
    ours = fit_power_law(torch.tensor(data), "ks")
    assert 1.5 < ours["alpha"] <= 3
    assert ours["xmin"] == fit.xmin
    assert ours["alpha"] == pytest.approx(fit.alpha, rel=1e-10)
    assert ours["D"] == pytest.approx(fit.D, rel=1e-10)


@pytest.mark.parametrize("N,seed", [(25, 0), (300, 1), (3000, 2), (5000, 3)])
def test_ks_search_equals_plain_loop(N, seed):
    # large N goes through the bound-and-prune search; it must pick the same candidate
    rng = np.random.default_rng(seed)
    if N <= 300:  # a random matrix's ESD
        ev = np.sort(np.linalg.svd(rng.standard_normal((2 * N, N)), compute_uv=False) ** 2)
    else:  # a bulk and a heavy tail
        ev = np.sort(np.concatenate([rng.gamma(2.0, 1.0, N - N // 10), pareto(N // 10, 3.0, seed, xmin=4.0)]))
    xmin, alpha, D = ww_loop_fit(ev)
    res = fit_power_law(torch.tensor(ev), "ks")
    assert res["xmin"] == xmin
    assert res["alpha"] == pytest.approx(alpha, rel=1e-9)
    assert res["D"] == pytest.approx(D, rel=1e-9)


def test_fit_power_law_list_input_is_batched_and_exact():
    # ESDs of equal length are fitted as one batch (bounds, pruning and exact distances across
    # rows); each must still be the plain loop's answer
    rng = np.random.default_rng(5)
    evs = [np.sort(np.concatenate([rng.gamma(2.0, 1.0, 1800), pareto(200, a, seed=s, xmin=4.0)]))
           for s, a in enumerate((2.5, 3.0, 4.0, 6.0))]
    evs.append(np.sort(np.linalg.svd(rng.standard_normal((400, 200)), compute_uv=False) ** 2))  # other length
    res = fit_power_law([torch.tensor(e) for e in evs], "ks")
    assert res["alpha"].shape == (5,)
    for k, ev in enumerate(evs):
        xmin, alpha, D = ww_loop_fit(ev)
        assert res["xmin"][k] == xmin
        assert res["alpha"][k] == pytest.approx(alpha, rel=1e-9)
        assert res["D"][k] == pytest.approx(D, rel=1e-9)
    peak = fit_power_law([torch.tensor(e) for e in evs], "peak")
    for k, ev in enumerate(evs):
        xmin, alpha, _ = tb_peak_loop_fit(ev)
        assert peak["xmin"][k] == xmin and peak["alpha"][k] == pytest.approx(alpha, rel=1e-9)


def test_peak_fit_hand_made():
    # a narrow bulk around 1 (the histogram peak) and a power-law tail from 3 on
    rng = np.random.default_rng(0)
    bulk = 10 ** rng.normal(0.0, 0.04, 600)
    tail = pareto(150, 3.0, seed=1, xmin=3.0)
    ev = np.sort(np.concatenate([bulk, tail]))
    xmin, alpha, D = tb_peak_loop_fit(ev)
    res = fit_power_law(torch.tensor(ev), "peak")
    assert res["xmin"] == xmin
    assert res["alpha"] == pytest.approx(alpha, rel=1e-9)
    assert res["D"] == pytest.approx(D, rel=1e-9)
    # the candidates stop at 1.5x the peak bin's edge, which is near 1
    assert res["xmin"] <= 1.5 * 1.2
    # the unconstrained search finds the tail instead
    assert fit_power_law(torch.tensor(ev), "ks")["xmin"] > 2.5


# --------------------------------------------------------------------------- ESDs


def test_conv2d_esd_is_kk_slices_by_hand():
    torch.manual_seed(0)
    conv = nn.Conv2d(5, 7, 3)
    w = conv.weight.detach().double()
    # TempBalance's construction: flatten the kernel, scale by sqrt(0.5), kernel position first
    mats = (torch.flatten(w, start_dim=2) * math.sqrt(0.5)).transpose(1, 2).transpose(0, 1)
    assert mats.shape == (9, 7, 5)
    expect = torch.linalg.svdvals(mats).square().flatten().sort().values
    got = layer_esd(conv.weight, "conv2d", dtype=torch.float64)
    torch.testing.assert_close(got, expect, rtol=1e-12, atol=1e-14)
    # the same by explicit slices
    slices = [w[:, :, i, j] for i in range(3) for j in range(3)]
    by_hand = np.sort(np.concatenate([np.linalg.svd(s.numpy(), compute_uv=False) ** 2 * 0.5 for s in slices]))
    np.testing.assert_allclose(got.numpy(), by_hand, rtol=1e-12)


def test_conv1d_and_hf_conv1d_esd():
    torch.manual_seed(0)
    conv = nn.Conv1d(6, 4, 5)
    w = conv.weight.detach().double()
    by_hand = np.sort(np.concatenate([np.linalg.svd(w[:, :, k].numpy(), compute_uv=False) ** 2 * 0.5
                                      for k in range(5)]))
    np.testing.assert_allclose(layer_esd(conv.weight, "conv1d", dtype=torch.float64).numpy(), by_hand, rtol=1e-12)
    lin = torch.randn(12, 9, dtype=torch.float64)
    np.testing.assert_allclose(layer_esd(lin.T, "hf_conv1d", dtype=torch.float64).numpy(),
                               layer_esd(lin, "linear", dtype=torch.float64).numpy(), rtol=1e-12)


def test_batched_esds_equal_per_layer():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(8, 8, 3), nn.Conv2d(8, 8, 3), nn.Conv2d(8, 16, 1), nn.Conv1d(16, 8, 3),
        nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 16), nn.Embedding(30, 8),
    )
    layers = matrix_layers(model)
    batched = compute_esds(layers, dtype=torch.float64)
    for layer, ev in zip(layers, batched):
        torch.testing.assert_close(ev, layer_esd(layer.weight, layer.kind, dtype=torch.float64), rtol=1e-12, atol=1e-14)
        assert ev.device == layer.weight.device and ev.dtype == torch.float64
    # the memory cap splits a shape group across several SVD calls without changing anything
    old = esd._MAX_STACK
    try:
        esd._MAX_STACK = 64 * 3
        for a, b in zip(compute_esds(layers, dtype=torch.float64), batched):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    finally:
        esd._MAX_STACK = old


# --------------------------------------------------------------------------- metrics by hand


def test_metrics_by_hand():
    torch.manual_seed(0)
    lin = nn.Linear(20, 30)
    w = lin.weight.detach().double().numpy()
    s = np.sort(np.linalg.svd(w, compute_uv=False))[::-1]
    ev = np.sort(s**2)
    df = analyze(nn.Sequential(lin), dtype=torch.float64, metrics="all").iloc[0]
    fit = fit_power_law(torch.tensor(ev), "ks")
    lam, norm = ev[-1], ev.sum()
    assert df["spectral_norm"] == pytest.approx(lam, rel=1e-12)
    assert df["log_spectral_norm"] == pytest.approx(np.log10(lam), rel=1e-12)
    assert df["norm"] == pytest.approx((w**2).sum(), rel=1e-12)
    assert df["log_norm"] == pytest.approx(np.log10(norm), rel=1e-12)
    assert df["stable_rank"] == pytest.approx(norm / lam, rel=1e-12)
    assert df["alpha"] == pytest.approx(fit["alpha"], rel=1e-12)
    assert df["alpha_weighted"] == pytest.approx(fit["alpha"] * np.log10(lam), rel=1e-12)
    assert df["log_alpha_norm"] == pytest.approx(np.log10((ev ** fit["alpha"]).sum()), rel=1e-12)
    # WW's matrix entropy: normalized by the log of the numerical rank
    p = ev / ev.sum() + 1e-10
    rank = (s > s.max() * 30 * np.finfo(np.float64).eps).sum()
    assert df["entropy"] == pytest.approx(-(p * np.log(p)).sum() / np.log(rank + 1e-10), rel=1e-12)
    # Spectrum's SNR: sums of singular values above / below the MP threshold, over the largest
    q75, q25 = np.quantile(s, [0.75, 0.25])
    thr = (q75 - q25) / 1.349 * (1 + np.sqrt(20 / 30))
    snr = s[s > thr].sum() / s[s <= thr].sum() / s[0]
    assert df["snr"] == pytest.approx(snr, rel=1e-12)
    assert 0 <= df["rand_distance"] < 1
    assert df["num_evals"] == 20 and df["shape"] == (30, 20) and df["kind"] == "linear"


def test_rand_distance_is_ww_js_distance_and_seeded():
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    x, y = np.sort(rng.gamma(2, 1, 50)), np.sort(rng.gamma(2, 1, 50))
    m = (x + y) / 2
    expect = np.sqrt((scipy_stats.entropy(x, m) + scipy_stats.entropy(y, m)) / 2)
    assert esd_metrics._js_distance(torch.tensor(x), torch.tensor(y)) == pytest.approx(expect, rel=1e-10)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.Conv2d(8, 8, 3))
    a = analyze(model, metrics=["rand_distance"], rand_seed=1)["rand_distance"].to_numpy()
    b = analyze(model, metrics=["rand_distance"], rand_seed=1)["rand_distance"].to_numpy()
    c = analyze(model, metrics=["rand_distance"], rand_seed=2)["rand_distance"].to_numpy()
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert "rand_distance" not in analyze(model).columns  # opt-in: it costs a second SVD


def test_metric_selection_and_columns():
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
    df = analyze(model, metrics=["stable_rank", "alpha"])
    assert list(df.columns) == ["name", "kind", "shape", "alpha", "stable_rank", "warning"]
    assert list(analyze(model).columns) == ["name", "kind", "shape", *htsr.DEFAULT_METRICS, "warning"]
    with pytest.raises(ValueError, match="unknown metrics"):
        analyze(model, metrics=["alpha", "bogus"])


def test_alphas_fast_path_equals_analyze():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Conv2d(4, 8, 3), nn.Linear(64, 64))
    fast = alphas(model)
    full = analyze(model, fit="median", filter_zeros=False, metrics=["alpha"], min_evals=1)
    assert list(fast) == list(full["name"])
    np.testing.assert_allclose(list(fast.values()), full["alpha"].to_numpy(), rtol=1e-12)
    ks = alphas(model, fit="ks", filter_zeros=True)
    np.testing.assert_allclose(list(ks.values()), analyze(model, min_evals=1)["alpha"].to_numpy(), rtol=1e-12)


# --------------------------------------------------------------------------- bad inputs


def test_unknown_fit_lists_valid_names():
    model = nn.Sequential(nn.Linear(16, 32))
    for call in (lambda: analyze(model, fit="mle"), lambda: alphas(model, fit="mle"),
                 lambda: fit_power_law(torch.rand(30), "mle")):
        with pytest.raises(ValueError, match="unknown fit 'mle'") as err:
            call()
        assert all(f in str(err.value) for f in FITS)


def test_nan_weights_name_the_layer():
    for bad in (float("nan"), float("inf")):
        model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16))
        with torch.no_grad():
            model[1].weight[3, 4] = bad
        for call in (analyze, alphas, lambda m: compute_esds(matrix_layers(m))):
            with pytest.raises(ValueError, match=r"layer\(s\) \['1'\] have NaN or Inf weights"):
                call(model)
    with pytest.raises(ValueError, match="NaN or Inf"):
        fit_power_law(torch.tensor([1.0, 2.0, float("nan"), 3.0]), "ks")


def test_all_zero_and_constant_weights_give_nan_row_and_warning():
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16))
    with torch.no_grad():
        model[1].weight.zero_()
        model[2].weight.fill_(0.3)  # rank 1
    with pytest.warns(UserWarning, match="no power-law fit.*'?1'? \\(") as rec:
        df = analyze(model).set_index("name")
    assert "2 (" in str(rec[0].message)
    assert math.isnan(df.loc["1", "alpha"]) and math.isnan(df.loc["2", "alpha"])
    assert df.loc["1", "norm"] == 0 and df.loc["2", "norm"] == pytest.approx(0.09 * 32 * 16, rel=1e-5)
    assert math.isfinite(df.loc["0", "alpha"])
    with pytest.warns(UserWarning, match="alpha is NaN"):
        a = alphas(model)
    assert math.isnan(a["1"]) and math.isfinite(a["0"])


def test_too_few_eigenvalues():
    with pytest.raises(ValueError, match="at least 3"):
        fit_power_law(torch.tensor([1.0, 2.0]), "ks")
    with pytest.raises(ValueError, match="ESD 1: .*at least 3"):
        fit_power_law([torch.rand(20) + 0.1, torch.tensor([1.0])], "median")
    model = nn.Sequential(nn.Linear(4, 32), nn.Linear(32, 64))  # 4 and 32 eigenvalues
    with pytest.warns(UserWarning, match=r"fewer than min_evals=10 eigenvalues: \['0'\]"):
        df = analyze(model)
    assert list(df["name"]) == ["1"]
    with pytest.warns(UserWarning, match=r"more than max_evals=20 eigenvalues: \['1'\]"):
        assert list(analyze(model, min_evals=1, max_evals=20)["name"]) == ["0"]


def test_model_without_matrix_layers():
    with pytest.raises(ValueError, match="nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding"):
        analyze(nn.Sequential(nn.ReLU(), nn.LayerNorm(8)))
    with pytest.raises(ValueError, match="no layer for spectral analysis"):
        alphas(nn.Sequential(nn.BatchNorm1d(4)))
    with pytest.raises(ValueError, match="unknown layer_types"):
        analyze(nn.Sequential(nn.Linear(8, 8)), layer_types=["dense"])
    with pytest.raises(ValueError, match="no layer for spectral analysis"):
        analyze(nn.Sequential(nn.Linear(16, 16)), layer_types=["conv2d"])


# --------------------------------------------------------------------------- figures


def test_plots_and_saved_report(tmp_path):
    from matplotlib.figure import Figure

    from lalr_lightning import viz

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Conv2d(8, 16, 3))
    ev = layer_esd(model[0].weight, "linear")
    fit = fit_power_law(ev, "ks")
    fig = viz.plot_esd(ev, alpha=fit["alpha"], xmin=fit["xmin"], title="fc")
    assert isinstance(fig, Figure) and len(fig.axes[0].lines) == 2  # tail + xmin
    hm = viz.plot_heatmap(np.random.rand(3, 4), ["a", "b", "c"], [0, 1, 2, 3], title="t", cbar_label="x")
    assert viz.figure_to_array(hm).shape[2] == 3
    with pytest.raises(ValueError, match="labels do not fit"):
        viz.plot_heatmap(np.zeros((2, 2)), ["a"], [0, 1])
    out = viz.save_esd_plots(model, None, tmp_path / "esd")
    files = sorted(p.name for p in out.iterdir())
    assert files == ["000_0.png", "001_1.png", "alpha_summary.png"]
    df = analyze(model, metrics=["alpha", "xmin"])
    viz.save_esd_plots(model, df.iloc[[1]], tmp_path / "one", summary=False)
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["000_1.png"]


def test_log_figure_routes_to_image_loggers(tmp_path):
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

    from lalr_lightning import viz

    got = []

    class FakeWandb(WandbLogger):  # wandb itself is optional: record the call instead
        def __init__(self):
            pass

        def log_image(self, key, images, step=None, **kw):
            got.append((key, images[0].shape, step))

    tb = TensorBoardLogger(tmp_path, name="tb")
    trainer = types.SimpleNamespace(loggers=[CSVLogger(tmp_path), tb, FakeWandb()], global_step=7, is_global_zero=True)
    fig = viz.plot_heatmap(np.eye(3), ["a", "b", "c"], [1, 2, 3])
    assert viz.log_figure(trainer, "lr/heatmap", fig) == 2
    assert got[0][0] == "lr/heatmap" and got[0][1][2] == 3 and got[0][2] == 7
    tb.experiment.flush()
    assert any(tb.log_dir and p.name.startswith("events") for p in (tmp_path / "tb").rglob("*"))
    assert not fig.axes  # closed
    only_csv = types.SimpleNamespace(loggers=[CSVLogger(tmp_path)], global_step=0)
    assert viz.log_figure(only_csv, "x", viz.plot_esd(torch.rand(50) + 0.1)) == 0


# --------------------------------------------------------------------------- extreme scales (issue 13.1)


def _float64_ww_alpha(w: torch.Tensor) -> float:
    """WW's recipe by hand in float64: eigenvalues > 1e-5 of W^T W, KS fit."""
    ev = np.linalg.svd(w.detach().double().numpy(), compute_uv=False) ** 2
    return ww_loop_fit(ev[ev > 1e-5])[1]


@pytest.mark.parametrize("rows", [300, 200])  # Gram route (falls back to an SVD) and float32 SVD route
def test_huge_weights_give_the_float64_answer(rows):
    # a finite weight above 1.8e19 overflows when squared in float32: the old path reported
    # alpha 1.0, D 1.0, spectral_norm inf
    torch.manual_seed(0)
    m = nn.Linear(200, rows, bias=False)
    with torch.no_grad():
        m.weight[0, :5] = 1e25
    model = nn.Sequential(m)
    expect = _float64_ww_alpha(m.weight)
    if rows == 300:
        assert expect == pytest.approx(1.3577, abs=1e-3)
    for dt in (torch.float32, torch.float64):
        row = analyze(model, dtype=dt).iloc[0]
        assert row["alpha"] == pytest.approx(expect, rel=1e-9 if dt == torch.float64 else 1e-5)
        assert row["spectral_norm"] == pytest.approx(5e50, rel=1e-5) and 0 < row["D"] < 1
    assert alphas(model, fit="ks", filter_zeros=True)["0"] == pytest.approx(expect, rel=1e-5)
    ev = compute_esds(matrix_layers(model))[0]
    assert ev.dtype == torch.float64 and float(ev[-1]) == pytest.approx(5e50, rel=1e-5)


@pytest.mark.parametrize("rows", [300, 200])
def test_tiny_weights_are_flagged_or_scale_free(rows):
    torch.manual_seed(0)
    m = nn.Linear(200, rows, bias=False)
    ref = alphas(nn.Sequential(m))["0"]  # median fit, no zero filter: scale-free
    with torch.no_grad():
        m.weight.mul_(1e-30)
    model = nn.Sequential(m)
    assert alphas(model)["0"] == pytest.approx(ref, rel=1e-5)  # the old path: NaN (underflow)
    with pytest.warns(UserWarning, match="0 of 200 eigenvalue"):
        row = analyze(model).iloc[0]
    # every true eigenvalue is below WW's 1e-5 zero filter: nothing to fit, and the table says so
    assert math.isnan(row["alpha"]) and "0 of 200 eigenvalue(s) above the zero filter" in row["warning"]
    lam = np.linalg.svd(m.weight.detach().double().numpy(), compute_uv=False)[0] ** 2
    assert row["spectral_norm"] == pytest.approx(lam, rel=1e-5) and lam < 1e-55


def test_unrepresentable_eigenvalues_name_the_layer():
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32)).double()
    with torch.no_grad():
        model[1].weight[0, 0] = 1e200  # finite, but its square is not a float64
    for call in (analyze, alphas, lambda m: compute_esds(matrix_layers(m))):
        with pytest.raises(ValueError, match=r"layer '1': its eigenvalues are not finite in float64"):
            call(model)


# --------------------------------------------------------------------------- degenerate matrices (issue 13.2)

def _check_row(row):
    """Every metric in its documented range, or NaN (inf for snr) with a reason in 'warning'."""
    finite = lambda v, r: math.isfinite(v)  # noqa: E731
    ranges = {
        "alpha": lambda v, r: 1 < v < math.inf, "xmin": lambda v, r: 0 < v <= r["xmax"],
        "xmax": lambda v, r: 0 < v <= r["spectral_norm"], "D": lambda v, r: 0 <= v <= 1,
        "sigma": lambda v, r: 0 <= v < math.inf, "num_pl_spikes": lambda v, r: 1 <= v <= r["num_evals"],
        "num_evals": lambda v, r: v >= 1, "spectral_norm": lambda v, r: 0 <= v < math.inf,
        "log_spectral_norm": finite, "norm": lambda v, r: r["spectral_norm"] <= v * (1 + 1e-9) < math.inf,
        "log_norm": finite, "stable_rank": lambda v, r: 1 - 1e-9 <= v <= r["num_evals"] * (1 + 1e-9),
        "entropy": lambda v, r: 0 <= v <= 1, "alpha_weighted": finite, "log_alpha_norm": finite,
        "rand_distance": lambda v, r: 0 <= v <= 1, "snr": lambda v, r: 0 <= v < math.inf,
    }
    for col, ok in ranges.items():
        v = float(row[col])
        if math.isnan(v) or (col == "snr" and math.isinf(v)):
            assert row["warning"], f"{row['name']}: {col} is {v} without a warning"
        else:
            assert ok(v, row), f"{row['name']}: {col} = {v} is outside its documented range"
    if math.isinf(float(row["snr"])):
        assert "snr inf" in row["warning"]


def test_degenerate_matrices_are_in_range_or_explained():
    torch.manual_seed(0)
    model = nn.ModuleDict({
        "rank1": nn.Linear(20, 30, bias=False), "row": nn.Linear(1000, 1, bias=False),
        "col": nn.Linear(1, 1000, bias=False), "zero": nn.Linear(20, 30, bias=False),
        "const": nn.Linear(20, 30, bias=False), "two": nn.Linear(2, 2, bias=False),
        "ortho": nn.Linear(64, 64, bias=False), "ok": nn.Linear(40, 60, bias=False),
    })
    with torch.no_grad():
        model["rank1"].weight.copy_(torch.outer(torch.randn(30), torch.randn(20)))
        model["zero"].weight.zero_()
        model["const"].weight.fill_(0.3)
        model["two"].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
        model["ortho"].weight.copy_(torch.linalg.qr(torch.randn(64, 64, dtype=torch.float64))[0])
    for dt in (torch.float32, torch.float64):
        with pytest.warns(UserWarning, match="no power-law fit"):
            df = analyze(model, metrics="all", min_evals=1, dtype=dt).set_index("name", drop=False)
        for _, row in df.iterrows():
            _check_row(row)
        # the old table: entropy 4581 (rank 1) and -1 (1 x N) from log(rank + 1e-10)
        for name in ("rank1", "row", "col", "const"):
            # float64 resolves the rounding noise of the stored float32 weights: a rank-1
            # matrix rounded to float32 has rank 20 there, and an entropy of 1e-8
            assert math.isnan(df.loc[name, "entropy"]) or (dt == torch.float64 and df.loc[name, "entropy"] < 1e-6)
            assert math.isnan(df.loc[name, "alpha"]) and "above the zero filter" in df.loc[name, "warning"]
            assert df.loc[name, "stable_rank"] == pytest.approx(1, rel=1e-6)
        for name in ("row", "col"):
            assert "numerical rank 1" in df.loc[name, "warning"]
        assert df.loc["const", "norm"] == pytest.approx(0.09 * 600, rel=1e-5)
        if dt == torch.float32:  # Spectrum: noise values all 0 at this precision
            assert df.loc["rank1", "snr"] == math.inf and "numerical rank 1" in df.loc["rank1", "warning"]
        assert df.loc["row", "snr"] == 1 and df.loc["col", "snr"] == 1  # one value, empty noise set
        zero = df.loc["zero"]
        assert zero["spectral_norm"] == 0 and zero["norm"] == 0 and "all-zero weights" in zero["warning"]
        assert all(math.isnan(zero[c]) for c in ("log_norm", "stable_rank", "entropy", "snr", "alpha"))
        # 2x2 diag(1, 2): eigenvalues 1 and 4, entropy by hand; 2 values are too few to fit
        p = np.array([0.2, 0.8]) + 1e-10
        assert df.loc["two", "entropy"] == pytest.approx(-(p * np.log(p)).sum() / np.log(2 + 1e-10), rel=1e-9)
        assert "2 of 2 eigenvalue(s)" in df.loc["two", "warning"]
        # an orthogonal matrix has a flat spectrum: no finite alpha (the old path: 4.5 million)
        assert "flat spectrum" in df.loc["ortho", "warning"] and df.loc["ortho", "entropy"] == 1
        assert math.isfinite(df.loc["ok", "alpha"]) and not df.loc["ok", "warning"].startswith("no power-law")


def test_rank_deficient_unfiltered_alpha_is_nan_not_rounding():
    # TempBalance's fast path fits every eigenvalue: on a rank-1 matrix the median is rounding
    # noise, which used to give a plausible alpha
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 30, bias=False), nn.Linear(30, 40, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.outer(torch.randn(30), torch.randn(20)))
    for dt in (torch.float32, torch.float64):
        with pytest.warns(UserWarning, match=r"alpha is NaN .*0 \(xmin .* is at the rounding level"):
            a = alphas(model, dtype=dt)
        assert math.isnan(a["0"]) and math.isfinite(a["1"])


def test_warning_column_flags_alpha_like_weightwatcher():
    ww = pytest.importorskip("weightwatcher")
    assert ww is not None
    df = analyze(nn.Sequential(nn.Linear(64, 128)), metrics=["alpha"])
    a, w = df.loc[0, "alpha"], df.loc[0, "warning"]
    assert ("under-trained" in w) == (a > 6) and ("over-trained" in w) == (a < 2)


# --------------------------------------------------------------------------- Spectrum's SNR (issue 11.2)


def spectrum_snr(s: np.ndarray, shape: tuple[int, int]) -> float:
    """Spectrum's rule (cognitivecomputations/spectrum, spectrum.py), written out: MP threshold
    from the IQR of the singular values; signal / noise sums; an empty noise set counts as 1; a
    zero noise sum gives inf; divided by the largest singular value."""
    q75, q25 = np.quantile(s, [0.75, 0.25])
    beta = min(shape) / max(shape)
    thr = (q75 - q25) / 1.349 * np.sqrt((1 + np.sqrt(beta)) ** 2)
    sig, noi = s[s > thr], s[s <= thr]
    signal = sig.sum() if len(sig) else 0.0
    noise = noi.sum() if len(noi) else 1.0
    return (signal / noise if noise != 0 else math.inf) / s.max()


def _diag_layer(values, rows=None) -> nn.Module:
    n = len(values)
    lin = nn.Linear(n, rows or n, bias=False)
    with torch.no_grad():
        lin.weight.zero_()
        lin.weight[:n, :n] = torch.diag(torch.tensor(values, dtype=torch.float32))
    return lin


@pytest.mark.parametrize("values,rows,expect", [
    ([1.0] * 7 + [10.0], None, 17 / 10),  # IQR 0: every value is signal, noise set empty -> 1
    ([0.0] * 4 + [1.0] * 4, None, 0.0),  # all noise: signal 0
    ([1.0, 2, 3, 4, 5, 6, 7, 20], None, None),  # mixed
    ([1.0, 2, 3, 4, 5, 6, 7, 20], 16, None),  # mixed, aspect ratio 1/2
    ([0.0] * 6 + [5.0, 6.0], None, math.inf),  # noise values all exactly 0
])
def test_snr_equals_spectrum_on_hand_built_spectra(values, rows, expect):
    lin = _diag_layer(values, rows)
    s = np.array(values)
    ref = spectrum_snr(s, tuple(lin.weight.shape))
    if expect is not None:
        assert ref == pytest.approx(expect, rel=1e-12)
    for dt in (torch.float32, torch.float64):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = analyze(nn.Sequential(lin), metrics=["snr"], min_evals=1, dtype=dt).loc[0, "snr"]
        assert got == pytest.approx(ref, rel=1e-6)


def test_snr_is_finite_for_orthogonal_and_fresh_matrices():
    timm = pytest.importorskip("timm")
    q = torch.linalg.qr(torch.randn(96, 96, dtype=torch.float64))[0]
    lin = nn.Linear(96, 96, bias=False)
    with torch.no_grad():
        lin.weight.copy_(3 * q)  # every singular value 3: above the threshold, noise set empty
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        snr = analyze(nn.Sequential(lin), metrics=["snr"]).loc[0, "snr"]
    assert snr == pytest.approx(96 * 3 / 1 / 3, rel=1e-5)  # Spectrum: (sum s) / 1 / s_max
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    df = analyze(vit, metrics=["snr"])
    assert np.isfinite(df["snr"]).all() and (df["snr"] > 0).all()


def test_layer_fits_is_the_table_per_layer_typed_with_why_and_no_warning():
    """One typed result per layer (LayerFit) for the programs that read a fit -- the table's numbers,
    and why a layer has none as data: failed (all-zero weights) or skipped (min_evals), no warning."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 48), nn.Linear(48, 4), nn.Linear(4, 4))
    with torch.no_grad():
        model[1].weight.zero_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fits = htsr.layer_fits(model, fit="ks", metrics=["alpha", "D", "num_evals", "stable_rank"], min_evals=10)
    with pytest.warns(UserWarning):
        df = analyze(model, fit="ks", metrics=["alpha", "D", "num_evals", "stable_rank"], min_evals=10)
    assert [f.name for f in fits] == ["0", "1", "2", "3"]
    assert [f.status for f in fits] == ["fitted", "failed", "skipped", "skipped"]
    assert fits[1].reason == "all-zero weights" and math.isnan(fits[1].alpha) and math.isnan(fits[1].value("alpha"))
    assert fits[2].reason == "fewer than min_evals=10 eigenvalues" and fits[2].num_evals == 4
    row = df.set_index("name").loc["0"]
    assert (fits[0].alpha, fits[0].D, fits[0].num_evals) == (row["alpha"], row["D"], row["num_evals"])
    assert fits[0].value("stable_rank") == row["stable_rank"] and set(fits[0].metrics) == {"stable_rank"}
    assert list(df["name"]) == ["0", "1"]  # the table leaves the skipped out
    fast = fit_layers(matrix_layers(model)[:2], fit="ks", filter_zeros=True)
    assert fast[0].alpha == fits[0].alpha and fast[1].status == "failed"
