"""lalr_lightning.core.linearization.ntk against explicit dense computations (seeds/001, Theorems 4-7)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
import torch
from torch import nn

from lalr_lightning.core.linearization import lambda_o, linearize, model_calls, ntk_groups, ntk_spectra
from lalr_lightning.core.linearization import ntk as N


def tiny_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3)).double()


class TinyCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3 * 4 * 4, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def tiny_cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = TinyCNN().double()
    with torch.no_grad():  # non-trivial running statistics, so eval() vs train() matters
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 2.0)
    return m


def explicit_jacobian(model: nn.Module, x: torch.Tensor, names: list[str]) -> torch.Tensor:
    """[N, C, P]: one torch.autograd.grad per output entry, in eval mode."""
    params = dict(model.named_parameters())
    was = model.training
    model.eval()
    out = model(x)
    rows = []
    for i in range(out.shape[0]):
        for c in range(out.shape[1]):
            g = torch.autograd.grad(out[i, c], [params[n] for n in names], retain_graph=True)
            rows.append(torch.cat([t.reshape(-1) for t in g]))
    model.train(was)
    return torch.stack(rows).reshape(out.shape[0], out.shape[1], -1)


def reference_kernels(jac: torch.Tensor, mode: str) -> torch.Tensor:
    n, c, _ = jac.shape
    if mode == "full":
        j = jac.reshape(n * c, -1)
        return j @ j.T
    if mode == "trace":
        return sum(jac[:, k] @ jac[:, k].T for k in range(c))
    s = jac.sum(1)
    return s @ s.T


def slices(model: nn.Module, names: list[str]) -> dict[str, slice]:
    params, out, start = dict(model.named_parameters()), {}, 0
    for n in names:
        out[n] = slice(start, start + params[n].numel())
        start += params[n].numel()
    return out


@pytest.mark.parametrize("mode", model_calls.MODES)
@pytest.mark.parametrize("which", ["mlp", "cnn"])
def test_K_and_S_equal_explicit_per_sample_gradients(which, mode):
    model = tiny_mlp() if which == "mlp" else tiny_cnn()
    x = torch.randn(6, 5, dtype=torch.float64) if which == "mlp" else torch.randn(5, 2, 4, 4, dtype=torch.float64)
    model.train()  # the NTK is taken in eval mode and the mode is restored
    groups = ntk_groups.layer_groups(model)
    names = list(ntk_groups.trainable_parameters(model))
    jac = explicit_jacobian(model, x, names)
    res = N.empirical_ntk(model, x, groups=groups, mode=mode)
    assert model.training and all(m.training for m in model.modules())
    torch.testing.assert_close(res.K, reference_kernels(jac, mode), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(sum(res.S.values()), res.K, rtol=1e-12, atol=1e-12)
    sl = slices(model, names)
    for layer, members in groups.items():  # S_l = J_l J_l^T with only the layer's columns
        cols = torch.cat([torch.arange(sl[n].start, sl[n].stop) for n in members])
        torch.testing.assert_close(res.S[layer], reference_kernels(jac[:, :, cols], mode), rtol=1e-10, atol=1e-12)
    expected_m = x.shape[0] * jac.shape[1] if mode == "full" else x.shape[0]
    assert res.K.shape == (expected_m, expected_m) and res.num_outputs == jac.shape[1]
    if which == "cnn":  # BatchNorm is tied to its conv: one layer with 4 tensors
        assert groups == {"conv": ["conv.weight", "conv.bias", "bn.weight", "bn.bias"], "fc": ["fc.weight", "fc.bias"]}


@pytest.mark.parametrize("mode", ["full", "trace"])
def test_chunked_equals_unchunked(mode):
    model, x = tiny_mlp(1), torch.randn(6, 5, dtype=torch.float64)
    groups = ntk_groups.layer_groups(model)
    p = sum(t.numel() for t in ntk_groups.trainable_parameters(model).values())
    ref = N.empirical_ntk(model, x, groups=groups, mode=mode)
    assert ref.jacobian_blocks == 1
    # rows per block: 1 (single gradients), 4 (< N: sample chunks), 12 (N..NC: class chunks of 2)
    for rows in (1, 4, 12):
        res = N.empirical_ntk(model, x, groups=groups, mode=mode, max_jacobian_numel=rows * p)
        torch.testing.assert_close(res.K, ref.K, rtol=1e-12, atol=1e-12)
        for k in groups:
            torch.testing.assert_close(res.S[k], ref.S[k], rtol=1e-12, atol=1e-12)
        assert res.jacobian_blocks > 1
    looped = N.empirical_ntk(model, x, groups=groups, mode=mode, vectorize=False, vmap_chunk=2)
    assert not looped.vectorized
    torch.testing.assert_close(looped.K, ref.K, rtol=1e-12, atol=1e-12)


def tiny_lora_bert(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=16, max_position_embeddings=12, num_labels=3)
    base = transformers.BertForSequenceClassification(cfg)
    model = peft.get_peft_model(base, peft.LoraConfig(task_type=peft.TaskType.SEQ_CLS, r=2, lora_alpha=4,
                                                      target_modules=["query", "value"]))
    with torch.no_grad():  # B = 0 at init would make the A gradients vanish
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    ids = torch.randint(0, 40, (3, 6))
    mask = torch.ones_like(ids)
    mask[1:, 4:] = 0
    return model.double(), {"input_ids": ids, "attention_mask": mask}


def test_hugging_face_lora_model_groups_and_kernel():
    model, inputs = tiny_lora_bert()
    groups = ntk_groups.layer_groups(model)
    pre = "base_model.model."
    assert list(groups) == [f"{pre}bert.encoder.layer.{i}.attention.self.{q}" for i in (0, 1) for q in ("query", "value")] + [
        f"{pre}classifier"]
    assert all(len(v) == 2 and "lora_A" in v[0] and "lora_B" in v[1] for v in list(groups.values())[:4])
    names = list(ntk_groups.trainable_parameters(model))
    params = dict(model.named_parameters())
    model.eval()
    out = model(**inputs).logits
    rows = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(out[i, c], [params[n] for n in names],
                                                                   retain_graph=True)])
            for i in range(3) for c in range(3)]
    jac = torch.stack(rows).reshape(3, 3, -1)
    res = N.empirical_ntk(model, inputs, groups=groups, mode="full")
    assert not res.vectorized  # HF mask code has data-dependent control flow: the loop fallback ran
    torch.testing.assert_close(res.K, reference_kernels(jac, "full"), rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(sum(res.S.values()), res.K)


class WithBareParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.out = nn.Linear(4, 2)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.out(self.inp(x) * self.scale)


def test_layer_groups_keep_untied_params_and_drop_frozen():
    model = WithBareParameter()
    model.inp.weight.requires_grad_(False)
    # frozen inp.weight is dropped, its bias stays in layer "inp"; the bare parameter is its own group
    assert ntk_groups.layer_groups(model) == {"inp": ["inp.bias"], "out": ["out.weight", "out.bias"], "scale": ["scale"]}
    seq = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    # a norm after a matrix joins its layer (matrix_layers' tie rule), even when the matrix is frozen
    seq[0].requires_grad_(False)
    assert ntk_groups.layer_groups(seq) == {"0": ["1.weight", "1.bias"], "2": ["2.weight", "2.bias"]}


# --------------------------------------------------------------------------- spectra


def random_psd(m: int, rank: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, rank, generator=g, dtype=torch.float64)
    return a @ a.T


def test_condition_number_and_eta_equal_dense_eigen_computations():
    model, x = tiny_mlp(2), torch.randn(7, 5, dtype=torch.float64)
    res = N.empirical_ntk(model, x, groups=ntk_groups.layer_groups(model), mode="full")
    K = res.K.numpy()
    for sigma in (0.0, 1e-3, 0.5):
        assert ntk_spectra.condition_number(res.K, sigma) == pytest.approx(np.linalg.cond(K + sigma * np.eye(len(K))), rel=1e-6)
        etas = ntk_spectra.layer_etas(res.K, res.S, sigma)
        for name, s in res.S.items():
            # generalized symmetric eigenproblem S v = mu (K + sigma I) v: the same spectrum as
            # (K + sigma I)^{-1/2} S (K + sigma I)^{-1/2}, by another algorithm
            mu = scipy.linalg.eigh(s.numpy(), K + sigma * np.eye(len(K)), eigvals_only=True)
            assert etas[name] == pytest.approx(np.abs(mu).max(), rel=1e-7)
            assert ntk_spectra.eta(res.K, s, sigma) == etas[name]
        if sigma == 0:  # sum_l K^{-1/2} S_l K^{-1/2} = I, so every eta_l <= 1
            assert max(etas.values()) <= 1 + 1e-9


def test_theorem6_bounds_hold_with_eta():
    k, s = random_psd(6, 8, 0), random_psd(6, 2, 1)
    e = ntk_spectra.eta(k, s)
    lk, lks = torch.linalg.eigvalsh(k), torch.linalg.eigvalsh(k + s)
    assert torch.all(lks >= (1 - e) * lk - 1e-9) and torch.all(lks <= (1 + e) * lk + 1e-9)


def test_singular_kernel_needs_sigma():
    k = random_psd(5, 2, 3)  # rank 2 < 5
    assert ntk_spectra.condition_number(k, 0.0) > 1e10 or math.isinf(ntk_spectra.condition_number(k, 0.0))
    with pytest.raises(ValueError, match="pass sigma > 0"):
        ntk_spectra.eta(k, random_psd(5, 1, 4))
    assert math.isfinite(ntk_spectra.eta(k, random_psd(5, 1, 4), sigma=1e-3))
    with pytest.raises(ValueError, match="sigma must be"):
        ntk_spectra.condition_number(k, -1.0)


def diag(*v):
    return torch.diag(torch.tensor(v, dtype=torch.float64))


def test_greedy_selection_by_eta_under_the_kappa_bound():
    # base (always trained) diag(1, 1), sigma 0.1, so K_sel + sigma I = diag(1.1, 1.1) at first
    S = {"a": diag(2, 2), "b": diag(0, 0.3), "c": diag(1.5, 0)}
    sel = ntk_spectra.greedy_ntk_selection(S, kappa_max=1.5, sigma=0.1, base=diag(1, 1))
    # round 1: eta a = 2/1.1, b = 0.3/1.1, c = 1.5/1.1 -> a (kappa of diag(3.1, 3.1) = 1)
    # round 2: eta b = 0.3/3.1, c = 1.5/3.1 -> c (kappa 4.6/3.1); round 3: b (kappa 4.6/3.4)
    assert sel.layers == ["a", "c", "b"] and sel.stopped == "exhausted"
    assert sel.eta == pytest.approx({"a": 2 / 1.1, "c": 1.5 / 3.1, "b": 0.3 / 3.1})
    assert sel.eta_rounds[0] == pytest.approx({"a": 2 / 1.1, "b": 0.3 / 1.1, "c": 1.5 / 1.1})
    assert sel.kappa == pytest.approx([1.0, 1.0, 4.6 / 3.1, 4.6 / 3.4])
    # a tighter bound: c is the best candidate of round 2 but would give kappa 1.484 > 1.4, so
    # selection stops there (b, which would fit, is not tried: the paper adds by eta while kappa allows)
    stop = ntk_spectra.greedy_ntk_selection(S, kappa_max=1.4, sigma=0.1, base=diag(1, 1))
    assert stop.layers == ["a"] and stop.stopped == "kappa"
    assert stop.rejected == "c" and stop.rejected_kappa == pytest.approx(4.6 / 3.1)
    assert ntk_spectra.greedy_ntk_selection(S, kappa_max=10, sigma=0.1, base=diag(1, 1), max_layers=2).layers == ["a", "c"]
    # without a base the first round compares with sigma I: eta_l = lambda_max(S_l) / sigma
    first = ntk_spectra.greedy_ntk_selection(S, kappa_max=1e9, sigma=0.1)
    assert first.eta_rounds[0] == pytest.approx({"a": 20, "b": 3, "c": 15}) and first.layers[0] == "a"
    with pytest.raises(ValueError, match="sigma > 0"):
        ntk_spectra.greedy_ntk_selection(S, kappa_max=10, sigma=0.0)


# --------------------------------------------------------------------------- linearization


def perturb(model: nn.Module, direction: dict, scale: float, anchor: dict) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(anchor[n] + scale * direction[n])


def test_linearized_model_agrees_to_first_order():
    model, x = tiny_mlp(3), torch.randn(8, 5, dtype=torch.float64)
    anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    direction = {n: torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in anchor.items()}
    f, f_lin = linearize.linearize(model, x, anchor)
    torch.testing.assert_close(f_lin, f, rtol=0, atol=1e-14)  # theta = theta_0: identical
    with torch.no_grad():
        f0 = model(x)
    jac0 = explicit_jacobian(model, x, list(anchor)).reshape(-1, sum(p.numel() for p in anchor.values()))
    dvec = torch.cat([direction[n].reshape(-1) for n in anchor])
    gaps, kls = [], []
    for k in range(5):
        scale = 0.04 / 2**k
        perturb(model, direction, scale, anchor)
        f, f_lin = linearize.linearize(model, x, anchor)
        gap = linearize.linearization_gap(f, f_lin)
        gaps.append(gap.gap)
        kls.append(gap.kl)
        # the gap is the plain l2 norm of f - f_0 - J_0 delta over all N x C outputs
        explicit = f0 + (jac0 @ (scale * dvec)).reshape(f0.shape)
        torch.testing.assert_close(f_lin, explicit, rtol=1e-10, atol=1e-12)
        assert gap.gap == pytest.approx(float(torch.linalg.vector_norm(f - explicit)), rel=1e-6)
    ratios = [a / b for a, b in zip(gaps, gaps[1:])]
    assert all(3.8 < r < 4.2 for r in ratios), ratios  # O(|delta|^2): halving delta quarters the gap
    kl_ratios = [a / b for a, b in zip(kls, kls[1:])]
    assert all(14 < r < 18 for r in kl_ratios), kl_ratios  # KL is quadratic in the logit gap: O(|delta|^4)


def test_linearization_gap_and_kl_formula():
    f = torch.tensor([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]], dtype=torch.float64)
    fl = torch.tensor([[1.5, 2.0, 0.0], [0.0, 0.0, 3.0]], dtype=torch.float64)
    res = linearize.linearization_gap(f, fl)
    assert res.gap == pytest.approx(math.sqrt(0.25 + 0.25 + 1.0))
    p, q = torch.softmax(f, 1), torch.softmax(fl, 1)
    assert res.kl == pytest.approx(float((p * (p / q).log()).sum(1).mean()))


def test_hugging_face_linearization_uses_jvp():
    model, inputs = tiny_lora_bert(1)
    anchor = {n: t.clone() for n, t in ntk_groups.trainable_parameters(model).items()}
    g = torch.Generator().manual_seed(1)
    direction = {n: torch.randn(t.shape, generator=g, dtype=torch.float64) for n, t in anchor.items()}
    gaps = []
    for scale in (0.02, 0.01):
        params = {n: anchor[n] + scale * direction[n] for n in anchor}
        f, f_lin = linearize.linearize(model, inputs, anchor, params)
        gaps.append(linearize.linearization_gap(f, f_lin).gap)
    assert 3.5 < gaps[0] / gaps[1] < 4.5


# --------------------------------------------------------------------------- Lip(f), lambda_o


def test_lip_power_iteration_equals_largest_singular_value():
    model, x = tiny_mlp(4), torch.randn(6, 5, dtype=torch.float64)
    names = list(ntk_groups.trainable_parameters(model))
    jac = explicit_jacobian(model, x, names).reshape(18, -1)
    top = float(torch.linalg.svdvals(jac)[0])
    lip = lambda_o.jacobian_spectral_norm(model, x, iters=300, tol=1e-14)
    assert lip == pytest.approx(top, rel=1e-9)
    full = N.empirical_ntk(model, x, mode="full").K  # ||J||_2^2 = lambda_max(J J^T)
    assert lip**2 == pytest.approx(float(torch.linalg.eigvalsh(full)[-1]), rel=1e-9)
    # seeded start vector: the same estimate on every rank, also when stopped early
    assert lambda_o.jacobian_spectral_norm(model, x, iters=10) == lambda_o.jacobian_spectral_norm(model, x, iters=10) < top


def test_lambda_o_formula_and_estimate():
    assert lambda_o.lambda_o(3.0, 2.0, 0.5) == 24.0  # 2 * 3 * 2 / 0.5
    model, x = tiny_mlp(5), torch.randn(6, 5, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    model.eval()
    with torch.no_grad():
        res_norm = float(torch.linalg.vector_norm(model(x) - nn.functional.one_hot(y, 3).double()))
    est = lambda_o.estimate_lambda_o(model, x, y, r=0.25, reduction="sum")
    assert est["residual_norm"] == pytest.approx(res_norm)
    assert est["lambda_o"] == pytest.approx(2 * res_norm * est["lip"] / 0.25)
    mean = lambda_o.estimate_lambda_o(model, x, y, r=0.25)
    assert mean["lambda_o"] == pytest.approx(est["lambda_o"] / 6)
    with pytest.raises(ValueError, match="r .*> 0"):
        lambda_o.lambda_o(1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="class targets"):
        lambda_o.estimate_lambda_o(model, x, y + 3, r=1.0)


# --------------------------------------------------------------------------- bad input


def test_bad_input_errors():
    model, x = tiny_mlp(), torch.randn(4, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match="valid: 'trace', 'full', 'sum'"):
        N.empirical_ntk(model, x, mode="diag")
    with pytest.raises(ValueError, match="not a parameter of"):
        N.empirical_ntk(model, x, params={"nope.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="in no group"):
        N.empirical_ntk(model, x, groups={"0": ["0.weight"]})
    with pytest.raises(ValueError, match="same batch dimension"):
        N.empirical_ntk(model, (x, torch.zeros(3)))
    frozen = tiny_mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        N.empirical_ntk(frozen, x)
    with pytest.raises(ValueError, match="anchor has no value"):
        linearize.linearize(model, x, {})


def test_callback_helpers_groups_head_and_sized_kernel():
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    params = ntk_groups.trainable_parameters(model)
    groups = ntk_groups.layer_groups(model, params)
    assert list(groups) == ["0", "2"] and ntk_groups.head_group(model, groups) == "2"
    assert ntk_groups.matching_groups(groups, None) == groups
    assert ntk_groups.matching_groups(groups, ["2*"]) == {"2": ["2.weight", "2.bias"]}
    with pytest.raises(ValueError, match=r"include pattern 'fc\*' matches no trainable layer; layers are: \['0', "):
        ntk_groups.matching_groups(groups, ["fc*"])
    layers = ntk_groups.group_layers(groups, params)
    assert [(la.name, list(la.params)) for la in layers] == [("0", ["0.weight", "0.bias"]),
                                                              ("2", ["2.weight", "2.bias"])]
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    said = []
    k, chosen = N.sized_ntk(model, x, params, groups, lambda text, warning: said.append((text, warning)), who="T",
                            mode="trace", positions="all", outputs=None)
    assert chosen is None and len(said) == 1 and said[0][0].startswith("T: J: 6 samples x 3 outputs") and not said[0][1]
    torch.testing.assert_close(k.K, N.empirical_ntk(model, x, params, groups).K)
    k2, chosen = N.sized_ntk(model, x, params, groups, lambda *_: said.append("again"), who="T", mode="trace",
                             positions="all", outputs=None, chosen=2)  # chosen already: no second estimate
    assert chosen == 2 and len(said) == 1 and k2.projected == 2
    assert k.ridge(0.5) == pytest.approx(0.5 * float(torch.trace(k.K)) / 6)
    with pytest.raises(ValueError, match="kernel"):
        model_calls.check_kernel("diag")


def test_the_kernel_options_and_the_trainable_groups_of_the_ntk_callbacks():
    assert N.check_kernel_options("full", "all", 4) == ("full", "all", 4)
    assert N.check_kernel_options("trace", "last", None) == ("trace", "last", None)
    for bad, what in ((("diag", "bad", None), "kernel"), (("trace", "bad", None), "positions")):
        with pytest.raises(ValueError, match=what):  # checked in order: the first bad one is named
            N.check_kernel_options(*bad)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)
    params, groups = N.trainable_groups(model, "T")
    assert list(params) == ["0.weight", "2.weight", "2.bias"] and groups == ntk_groups.layer_groups(model, params)
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="^T: Sequential has no trainable parameters"):
        N.trainable_groups(model, "T")


def test_head_selection_starts_from_the_head_and_says_when_only_it_fits():
    eye, spike = torch.eye(2, dtype=torch.float64), torch.diag(torch.tensor([100.0, 0.0], dtype=torch.float64))
    sel, note = ntk_spectra.head_selection({"a": eye, "head": eye}, "head", 10.0, 1e-6)
    assert sel.layers == ["a"] and note is None
    sel, note = ntk_spectra.head_selection({"a": spike, "head": eye}, "head", 10.0, 1e-6)
    assert sel.layers == [] and note.startswith("NTKSelect: only the head 'head' trains")
    sel, note = ntk_spectra.head_selection({"a": eye, "b": 2 * eye}, None, 10.0, 1e-6)
    assert sel.layers[0] == "b" and note is None  # no head: every layer ranked, the largest eta first
    with pytest.raises(ValueError, match="no layer keeps kappa"):
        ntk_spectra.head_selection({"a": spike}, None, 10.0, 1e-6)


def test_unit_lambda_o_reads_class_targets_or_the_modules_own_loss():
    model = nn.Sequential(nn.Linear(4, 3))
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 2, 0, 1])
    theta0 = ntk_groups.trainable_parameters(model)
    value, own = lambda_o.unit_lambda_o(model, (x, y), theta0)
    assert not own and value == pytest.approx(lambda_o.estimate_lambda_o(model, x, y, 1.0, theta0)["lambda_o"])
    loss_fn = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    value, own = lambda_o.unit_lambda_o(model, (x, y), theta0, loss_fn)
    want = lambda_o.estimate_lambda_o(model, x, None, 1.0, theta0, loss=lambda: loss_fn(model, (x, y)))["lambda_o"]
    assert own and value == pytest.approx(want)


def test_selectable_head_or_why_there_is_nothing_to_select():
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3))
    groups = ntk_groups.layer_groups(model)
    assert ntk_groups.selectable_head(model, groups, False) is None and ntk_groups.selectable_head(model, groups, True) == "4"
    with pytest.raises(ValueError, match="one trainable layer besides the head"):
        ntk_groups.selectable_head(model, {g: groups[g] for g in ("0", "4")}, True)
    with pytest.raises(ValueError, match=r"has one trainable layer \(\['0'\]\); there is nothing to select between"):
        ntk_groups.selectable_head(model, {"0": groups["0"]}, False)
    with pytest.raises(ValueError, match=r"NTKSelect\(head=True\): no trainable output layer found in Sequential"):
        ntk_groups.selectable_head(model, {g: groups[g] for g in ("0", "2")}, True)
