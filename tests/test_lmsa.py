"""LMSAStepper and core.selection.msa: the L-MSA metric (eq. 8-9, Prop. 3.1-3.2), the Hamiltonian
maximization (eq. 10, 13), and the callback's behaviour under Lightning (freezing, re-selection,
resume, DDP, gradient accumulation, bad input)."""

from __future__ import annotations

import copy
import math

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.optimize import minimize_scalar
from torch import nn
from torch.utils.data import DataLoader

from lalr_lightning.callbacks.lmsa import LMSAStepper
from lalr_lightning.core.model.blocks import block_layers
from lalr_lightning.core.model.taps import BlockTaps
from lalr_lightning.core.selection import msa
from tests._dist import ddp_spawn
from tests._toys import DeepLinear, MemLogger, ToyMLP, make_data, make_trainer


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: one intra-op thread avoids OpenMP stalls on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ============================================================================ helpers


def _linear_setup(K, dims=(5, 6, 4, 7, 3), seed=0):
    model = DeepLinear(dims, seed)
    g = torch.Generator().manual_seed(seed + 1)
    X = torch.randn(K, dims[0], generator=g, dtype=torch.float64)
    Y = torch.randn(K, dims[-1], generator=g, dtype=torch.float64)

    def run():
        return 0.5 * (model(X) - Y).square().sum()  # J = 1/2 sum_i ||y^i - x_N^i||^2

    layers = block_layers(model)
    taps = BlockTaps(model, layers)
    taps.discover(run)
    taps.set_capture([b.name for b in layers])
    loss = run()
    loss.backward()
    # the paper's quantities by hand, columns = samples
    th = [layer.weight.detach() for layer in model.layers]
    xs = [X.T]
    for t in th:
        xs.append(t @ xs[-1])
    ps = [None] * (len(th) + 1)
    ps[-1] = Y.T - xs[-1]  # p_N = -grad Phi
    for n in range(len(th) - 1, -1, -1):
        ps[n] = th[n].T @ ps[n + 1]
    return model, X, Y, run, layers, taps, float(loss.detach()), th, xs, ps


def _beta(th, n, d):
    beta = torch.eye(d, dtype=torch.float64)
    for t in th[n + 1:]:
        beta = t @ beta
    return beta


# ============================================================================ eq. 8-9, Prop. 3.1-3.2


@pytest.mark.parametrize("K", [1, 8])
def test_states_and_costates_are_the_papers(K):
    *_, layers, taps, loss, th, xs, ps = _linear_setup(K)
    for n, layer in enumerate(layers):
        (cap,) = taps.captures[layer.name]
        torch.testing.assert_close(cap.args[0].T, xs[n], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(cap.out.T, xs[n + 1], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(cap.p.T, ps[n + 1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("K", [1, 8])
def test_metric_is_the_loss_after_the_one_step_update(K):
    """Proposition 3.1 / A.1: with a given rho, J_hat_n is the loss after theta_n + (1/rho) p x^T."""
    model, X, Y, run, layers, taps, loss, th, xs, ps = _linear_setup(K)
    d_out = xs[-1].shape[0]
    for rho in (0.7, 3.7, 40.0):
        for n, layer in enumerate(layers):
            cap = taps.captures[layer.name][0]
            score = msa.block_score(
                taps.block_fn(layer.name, cap, run), taps.theta(layer.name), cap.p,
                lambda t, name=layer.name, cap=cap: float(taps.loss_with(run, {name: t}, {name: cap})),
                loss, d_out, rho=rho,
            )
            beta = _beta(th, n, th[n].shape[0])
            theta_new = th[n] + ps[n + 1] @ xs[n].T / rho  # eq. 13
            loss_after = 0.5 * (Y.T - beta @ theta_new @ xs[n]).square().sum()
            eq8 = msa.linear_j_hat(xs[n], xs[n + 1], ps[n + 1], rho, lambda z, beta=beta: 0.5 * (Y.T - beta @ z).square().sum())
            assert score.j_hat == pytest.approx(float(loss_after), rel=1e-10)
            assert score.j_hat == pytest.approx(float(eq8), rel=1e-10)
            assert score.rho_hat == rho


@pytest.mark.parametrize("K", [1, 8])
def test_rho_hat_is_eq9_and_rho_star_minimizes_the_updated_loss(K):
    """eq. 9 from the generic (JVP) form; eq. 12 minimizes the updated loss; Prop. 3.2 bound."""
    model, X, Y, run, layers, taps, loss, th, xs, ps = _linear_setup(K)
    d_out = xs[-1].shape[0]
    for n, layer in enumerate(layers):
        cap = taps.captures[layer.name][0]
        fn = taps.block_fn(layer.name, cap, run)
        r = msa.block_direction(fn, taps.theta(layer.name), cap.p)
        torch.testing.assert_close(r[0], ps[n + 1] @ xs[n].T, rtol=1e-12, atol=1e-12)  # r_n = p x^T
        delta = msa.output_change(fn, taps.theta(layer.name), r)
        torch.testing.assert_close(delta.T, ps[n + 1] @ xs[n].T @ xs[n], rtol=1e-12, atol=1e-12)  # r x
        rho_hat = msa.rho_hat(cap.p, delta, r, loss, d_out)
        assert rho_hat == pytest.approx(float(msa.linear_rho_hat(xs[n], ps[n + 1], loss, d_out)), rel=1e-10)
        score = msa.block_score(fn, taps.theta(layer.name), cap.p,
                                lambda t, name=layer.name, cap=cap: float(taps.loss_with(run, {name: t}, {name: cap})),
                                loss, d_out)
        assert score.rho_hat == pytest.approx(rho_hat, rel=1e-12)
        # the metric with rho_hat is eq. 8 with rho_hat
        beta = _beta(th, n, th[n].shape[0])

        def updated(alpha, n=n, beta=beta):  # loss after theta_n + alpha r_n
            return float(0.5 * (Y.T - beta @ (th[n] + alpha * ps[n + 1] @ xs[n].T) @ xs[n]).square().sum())

        assert score.j_hat == pytest.approx(updated(1 / rho_hat), rel=1e-10)
        rho_star = float(msa.linear_rho_star(beta, xs[n], ps[n + 1]))
        best = minimize_scalar(updated, bracket=(0.0, 1.0 / rho_star), tol=1e-12)
        assert 1.0 / rho_star == pytest.approx(best.x, rel=1e-5)
        grid = np.linspace(0.0, 4.0 / rho_star, 4001)
        assert updated(1 / rho_star) <= min(updated(a) for a in grid) + 1e-12
        assert rho_star >= rho_hat / d_out * (1 - 1e-12)  # Proposition 3.2


# ============================================================================ non-linear blocks


def _independent_scores(fns, params, x, y, loss_fn, out_dim, rho_scale=1.0):
    """J_hat, rho_hat per block without hooks or functional_call: autograd on explicit block
    functions, forward-mode JVP, and the loss of a network whose block n is replaced."""
    xs = [x]
    with torch.no_grad():
        for f, p in zip(fns, params):
            xs.append(f(xs[-1], p))

    def rest(n, z):
        for f, p in zip(fns[n + 1:], params[n + 1:]):
            z = f(z, p)
        return loss_fn(z, y)

    J = float(rest(len(fns) - 1, xs[-1]))
    out = []
    for n in range(len(fns)):
        z = xs[n + 1].clone().requires_grad_(True)
        (g,) = torch.autograd.grad(rest(n, z), z)
        P = -g
        th = [t.detach().clone().requires_grad_(True) for t in params[n]]
        r = [-g for g in torch.autograd.grad(rest(n, fns[n](xs[n], th)), th)]
        _, delta = torch.func.jvp(lambda *t, n=n: fns[n](xs[n], list(t)), tuple(t.detach() for t in th), tuple(r))
        K = x.shape[0]
        m = P.reshape(K, -1) @ delta.reshape(K, -1).T
        rho = rho_scale * out_dim / (2 * J) * float(m.square().sum()) / float(sum(t.square().sum() for t in r))
        with torch.no_grad():
            j = float(rest(n, fns[n](xs[n], [t + d / rho for t, d in zip(th, r)])))
        out.append((j, rho, xs[n], xs[n + 1], P))
    return J, out


class FlatMLP(nn.Module):
    def __init__(self, d=5, w=7, c=4, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(d, w), nn.Tanh(), nn.Linear(w, w), nn.Tanh(), nn.Linear(w, w), nn.Tanh(),
                                 nn.Linear(w, c))
        self.double()

    def forward(self, x):
        return self.net(x)


def _lin(x, p):
    return F.linear(x, p[0], p[1])


def test_nonlinear_metric_is_the_loss_after_the_update_and_reduces_to_eq8_for_linear_blocks():
    model = FlatMLP()
    g = torch.Generator().manual_seed(3)
    X = torch.randn(6, 5, generator=g, dtype=torch.float64)
    Y = torch.randint(0, 4, (6,), generator=g)

    def run():
        return F.cross_entropy(model(X), Y)

    # block 0 spans two modules (net.0 and net.2: run through the model's forward), block 1 is
    # net.4 alone, the head net.6 is linear
    layers = block_layers(model, blocks=[["net.0", "net.2"], "net.4"])
    assert [b.name for b in layers] == ["net.0+net.2", "net.4", "net.6"]
    taps = BlockTaps(model, layers)
    taps.discover(run)
    assert taps.blocks["net.0+net.2"].module is None and taps.blocks["net.4"].module is not None
    taps.set_capture([b.name for b in layers])
    loss = run()
    loss.backward()
    net = model.net
    fns = [lambda x, p: _lin(torch.tanh(_lin(x, p[:2])), p[2:]),
           lambda x, p: _lin(torch.tanh(x), p),
           lambda x, p: _lin(torch.tanh(x), p)]
    params = [[net[0].weight, net[0].bias, net[2].weight, net[2].bias], [net[4].weight, net[4].bias],
              [net[6].weight, net[6].bias]]
    params = [[t.detach() for t in ps] for ps in params]
    J, ref = _independent_scores(fns, params, X, Y, F.cross_entropy, 4, rho_scale=2.0)
    assert float(loss.detach()) == pytest.approx(J, rel=1e-12)
    for n, layer in enumerate(layers):
        cap = taps.captures[layer.name][0]
        score = msa.block_score(
            taps.block_fn(layer.name, cap, run), taps.theta(layer.name), cap.p,
            lambda t, name=layer.name, cap=cap: float(taps.loss_with(run, {name: t}, {name: cap})),
            float(loss), 4, rho_scale=2.0,
        )
        j_ref, rho_ref, x_n, x_next, P = ref[n]
        assert score.rho_hat == pytest.approx(rho_ref, rel=1e-9)
        assert score.j_hat == pytest.approx(j_ref, rel=1e-10)
        assert score.j_hat < float(loss)  # a descent step of a sensible size
        if n >= 1:
            # the linear part of the block (tanh then Linear: the Linear sees tanh(x_n)) with a
            # bias is eq. 8-9 on the augmented input [tanh(x_n); 1]
            xa = torch.cat([torch.tanh(x_n), torch.ones(x_n.shape[0], 1, dtype=x_n.dtype)], 1).T

            def G(z, n=n):
                for f, p in zip(fns[n + 1:], params[n + 1:]):
                    z = f(z.T, p).T
                return F.cross_entropy(z.T, Y)

            rho9 = 2.0 * float(msa.linear_rho_hat(xa, P.T, float(loss), 4))
            assert score.rho_hat == pytest.approx(rho9, rel=1e-9)
            eq8 = float(msa.linear_j_hat(xa, x_next.T, P.T, rho9, G))
            assert score.j_hat == pytest.approx(eq8, rel=1e-10)


# ============================================================================ Hamiltonian maximization


def _single_linear_term(K=4, d=5, e=3, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(d, e, bias=False).double()
    x = torch.randn(K, d, dtype=torch.float64)
    p = torch.randn(K, e, dtype=torch.float64)

    def fn(theta, xin=None):
        return F.linear(x if xin is None else xin, theta[0])

    return lin, x, p, fn


def test_msa_step_is_eq13_and_increases_h():
    rho = 50.0
    lin, x, p, fn = _single_linear_term()
    theta0 = lin.weight.detach().clone()
    closed = theta0 + p.T @ x / rho  # theta + (1/rho) p x^T (paper layout: p x^T = P^T X)
    term = msa.HamiltonianTerm(fn, [0], p)
    # gradient ascent with step 1/rho lands on the maximizer in one step and stays there
    opt = torch.optim.SGD([lin.weight], lr=1 / rho)
    msa.maximize_hamiltonian([term], [lin.weight], opt, steps=1, rho=rho)
    torch.testing.assert_close(lin.weight.detach(), closed, rtol=1e-12, atol=1e-12)
    # the next batch anchors at the new theta: one step of r/rho more, then a fixed point
    msa.maximize_hamiltonian([term], [lin.weight], opt, steps=3, rho=rho)
    torch.testing.assert_close(lin.weight.detach(), closed + p.T @ x / rho, rtol=1e-10, atol=1e-10)
    # Adam (the paper's inner optimizer) converges to the same maximizer of the concave H
    with torch.no_grad():
        lin.weight.copy_(theta0)
    opt = torch.optim.Adam([lin.weight], lr=1e-2)
    values = msa.maximize_hamiltonian([term], [lin.weight], opt, steps=400, rho=rho)
    torch.testing.assert_close(lin.weight.detach(), closed, rtol=1e-6, atol=1e-8)
    assert values[-1] > values[0]
    # the paper's setting (Adam lr 1e-4, 5 iterations, rho 1) increases H
    with torch.no_grad():
        lin.weight.copy_(theta0)
    opt = torch.optim.Adam([lin.weight], lr=1e-4)
    msa.maximize_hamiltonian([term], [lin.weight], opt, steps=5, rho=1.0)
    h_before = float(msa.hamiltonian([term], [theta0], [theta0], 1.0))
    h_after = float(msa.hamiltonian([term], [lin.weight.detach()], [theta0], 1.0))
    assert h_after > h_before


def test_maximize_leaves_grads_untouched_and_uses_reduce():
    lin, x, p, fn = _single_linear_term()
    g0 = torch.full_like(lin.weight, 7.0)
    lin.weight.grad = g0
    seen = []

    def reduce(grads):
        seen.append(len(grads))
        return [2 * g for g in grads]

    theta0 = lin.weight.detach().clone()
    opt = torch.optim.SGD([lin.weight], lr=0.01)
    msa.maximize_hamiltonian([msa.HamiltonianTerm(fn, [0], p)], [lin.weight], opt, steps=1, rho=1.0,
                             reduce_grads=reduce)
    assert lin.weight.grad is g0 and seen == [1]
    torch.testing.assert_close(lin.weight.detach(), theta0 + 0.01 * 2 * p.T @ x, rtol=1e-12, atol=1e-12)


def test_feasibility_terms_vanish_at_the_anchor_and_h_increases():
    torch.manual_seed(1)
    lin = nn.Linear(5, 3).double()
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    out = torch.tanh(lin(x))
    w = torch.randn(4, 3, dtype=torch.float64)
    loss = (w * out).sum() ** 2 / 10
    p_next_t, p_in_t = torch.autograd.grad(loss, [out, x])
    p_next, p_in = -p_next_t, -p_in_t  # co-states from a real backward pass

    def fn(theta, xin=None):
        return torch.tanh(F.linear(x.detach() if xin is None else xin, theta[0], theta[1]))

    theta0 = [lin.weight.detach().clone(), lin.bias.detach().clone()]
    aug = msa.HamiltonianTerm(fn, [0, 1], p_next, x_next=out.detach(), x_in=x.detach(), p_in=p_in)
    plain = msa.HamiltonianTerm(fn, [0, 1], p_next)
    h_aug = float(msa.hamiltonian([aug], theta0, theta0, 1.0, feasibility=3.0))
    h_plain = float(msa.hamiltonian([plain], theta0, theta0, 1.0))
    assert h_aug == pytest.approx(h_plain, rel=1e-12, abs=1e-12)
    moved = [t + 0.1 for t in theta0]
    assert float(msa.hamiltonian([aug], moved, theta0, 1.0, feasibility=3.0)) < float(
        msa.hamiltonian([plain], moved, theta0, 1.0))
    opt = torch.optim.Adam(lin.parameters(), lr=1e-3)
    values = msa.maximize_hamiltonian([aug], list(lin.parameters()), opt, steps=20, rho=1.0, feasibility=3.0)
    assert values[-1] > values[0]


class TupleBlock(nn.Module):
    """A Hugging Face style layer: keyword inputs, returns ``(hidden_states, extra)``."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, hidden_states, scale=None):
        h = torch.tanh(self.lin(hidden_states)) * scale
        return (h, h.mean())


class DictBlock(TupleBlock):
    def forward(self, hidden_states, scale=None):
        return {"h": super().forward(hidden_states, scale)[0]}


class HFStyle(nn.Module):
    def __init__(self, block=TupleBlock, d=4):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.ModuleList([block(d) for _ in range(2)])
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        scale = torch.full((1, x.shape[1]), 0.5)
        for blk in self.layer:
            out = blk(x, scale=scale)
            x = out[0] if isinstance(out, tuple) else out["h"]
        return self.head(x)


def test_tuple_output_blocks_with_keyword_inputs_and_a_clear_error_for_dicts():
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 0, 1, 1])
    model = HFStyle()

    def run():
        return F.cross_entropy(model(x), y)

    layers = block_layers(model)
    taps = BlockTaps(model, layers)
    taps.discover(run)
    taps.set_capture([b.name for b in layers])
    loss = run()
    loss.backward()
    cap = taps.captures["layer.0"][0]
    assert "scale" in cap.kwargs and cap.out.shape == (5, 4) and cap.p.shape == (5, 4)
    fn = taps.block_fn("layer.0", cap, run)
    torch.testing.assert_close(fn(taps.theta("layer.0")), cap.out)
    score = msa.block_score(fn, taps.theta("layer.0"), cap.p,
                            lambda t: float(taps.loss_with(run, {"layer.0": t}, {"layer.0": cap})), float(loss), 2)
    assert math.isfinite(score.j_hat) and score.j_hat < float(loss)
    model = HFStyle(DictBlock)
    taps = BlockTaps(model, block_layers(model))
    taps.discover(run)
    taps.set_capture(["layer.0"])
    with pytest.raises(TypeError, match="returns dict"):
        run()


def test_select_smallest():
    assert msa.select_smallest({"a": 3.0, "b": 1.0, "c": 2.0}) == ["b"]
    assert msa.select_smallest({"a": 3.0, "b": 1.0, "c": 2.0}, k=2) == ["b", "c"]
    assert msa.select_smallest({"a": 1.0, "b": 1.0}) == ["a"]
    assert msa.select_smallest({"a": math.inf, "b": 5.0}) == ["b"]


# ============================================================================ Lightning


class BlockNet(pl.LightningModule):
    """stem (joined to blocks.0 by block_layers) -> 3 Linear+Tanh blocks -> fc."""

    def __init__(self, d=6, w=8, classes=3, n=32, batch_size=8, lr=0.05, seed=0, bn=False):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.stem = nn.Linear(d, w)
        norm = (lambda: nn.BatchNorm1d(w)) if bn else nn.Identity
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(w, w), norm(), nn.Tanh()) for _ in range(3)])
        self.fc = nn.Linear(w, classes)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        for b in self.blocks:
            x = b(x)
        return self.fc(x)

    def loss(self, out, y):
        return F.cross_entropy(out, y)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss(self(x), y)

    def validation_step(self, batch, batch_idx):  # runs between epochs: nothing may be captured there
        x, y = batch
        self.log("val_loss", self.loss(self(x), y))

    def train_dataloader(self):
        h = self.hparams
        return DataLoader(make_data(h.n, h.d, h.classes, h.seed), batch_size=h.batch_size, shuffle=False)

    def val_dataloader(self):
        return DataLoader(make_data(8, self.hparams.d, self.hparams.classes, 99), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9, weight_decay=1e-3)


class NaNNet(BlockNet):
    def loss(self, out, y):
        return F.cross_entropy(out, y) * float("nan")


def toy_loss(pl_module, batch):
    x, y = batch
    return F.cross_entropy(pl_module(x), y)


def _trainer(cb, max_epochs=1, **kw):
    return make_trainer([cb], max_epochs=max_epochs, **kw)


def _blocks_of(model):
    return {b.name: {n: p.detach().clone() for n, p in b.params.items()} for b in block_layers(model)}


def _block_fns(model):
    return [
        lambda x, p: torch.tanh(F.linear(torch.relu(F.linear(x, p[0], p[1])), p[2], p[3])),
        lambda x, p: torch.tanh(F.linear(x, p[0], p[1])),
        lambda x, p: torch.tanh(F.linear(x, p[0], p[1])),
        lambda x, p: F.linear(x, p[0], p[1]),
    ]


def test_callback_scores_match_an_independent_computation():
    model = BlockNet()
    init = copy.deepcopy(model)
    logger = MemLogger()
    cb = LMSAStepper(rho_scale=3.0)
    _trainer(cb, max_steps=1, logger=logger).fit(model)
    names = [b.name for b in block_layers(init)]
    assert len(names) == 4 and names[0].startswith("stem+") and list(cb.scores) == names
    x, y = make_data(32, 6, 3, 0)[:8]
    params = [[t.detach() for t in b.params.values()] for b in block_layers(init)]
    J, ref = _independent_scores(_block_fns(init), params, x, y, F.cross_entropy, 3, rho_scale=3.0)
    for n, name in enumerate(names):
        assert cb.scores[name] == pytest.approx(ref[n][0], rel=1e-5)
        assert cb.rho_hat[name] == pytest.approx(ref[n][1], rel=1e-4)
        rgn = math.sqrt(sum(float(g.square().sum()) for g in torch.autograd.grad(
            F.cross_entropy(init(x), y), list(block_layers(init)[n].params.values())))) / math.sqrt(
            sum(float(t.square().sum()) for t in params[n]))
        assert cb.rgn[name] == pytest.approx(rgn, rel=1e-4)
    best = min(names, key=lambda n: ref[names.index(n)][0])
    assert cb.selected == [best]
    logged = {k: v for _, m in logger.rows for k, v in m.items()}
    for name in names:
        assert logged[f"lmsa/j_hat/{name}"] == pytest.approx(cb.scores[name])
        assert f"lmsa/rho_hat/{name}" in logged and f"lmsa/rgn/{name}" in logged
        assert logged[f"lmsa/selected/{name}"] == float(name == best)


def _buffers_of(model):
    return {b.name: {n: t.clone() for m in b.modules for n, t in m.named_buffers()} for b in block_layers(model)}


@pytest.mark.parametrize("update,select", [("msa", "min"), ("optimizer", "min"), ("msa", "all")])
def test_only_the_selected_blocks_change(update, select):
    model = BlockNet(bn=True)
    before, buffers = _blocks_of(model), _buffers_of(model)
    cb = LMSAStepper(update=update, select=select, **({"inner_lr": 1e-2} if update == "msa" else {}))
    _trainer(cb, max_epochs=2).fit(model)
    after, buffers_after = _blocks_of(model), _buffers_of(model)
    for name in cb.selected:  # norm_eval="frozen": only the trained blocks' statistics adapt
        assert buffers[name].keys() == buffers_after[name].keys()
    for name in set(before) - set(cb.selected):
        assert all(torch.equal(buffers[name][k], buffers_after[name][k]) for k in buffers[name]), name
    assert cb.selected == (list(before) if select == "all" else cb.selected) and len(cb.selected) >= 1
    for name in before:
        same = all(torch.equal(before[name][k], after[name][k]) for k in before[name])
        if name in cb.selected:
            assert not same, f"selected block {name} did not change"
        else:
            assert same, f"block {name} changed although {cb.selected} was selected"
    if update == "msa":
        # the inner optimizer did all the updates: 4 steps x 2 epochs x 5 iterations
        state = cb._inner.state_dict()["state"]
        assert all(int(s["step"]) == 40 for s in state.values())


@pytest.mark.parametrize("feasibility", [0.0, 1.0])
def test_msa_update_equals_the_hamiltonian_step_on_the_batch(feasibility):
    """With inner SGD one iteration is eq. 13: theta_m + lr r_m = theta_m - lr dL/dtheta_m on the
    batch, for every selected block -- the joined stem block (run through the model's forward)
    included. E-MSA's feasibility terms have zero gradient at theta_m, so they do not change
    that first step (their co-state p_m is read by a hook on the block's input)."""
    model = BlockNet()
    init = copy.deepcopy(model)
    cb = LMSAStepper(inner_optimizer="sgd", inner_lr=0.5, rho=2.0, inner_steps=1, num_blocks=4,
                     feasibility=feasibility)
    _trainer(cb, max_steps=1).fit(model)
    assert len(cb.selected) == 4
    x, y = make_data(32, 6, 3, 0)[:8]
    loss = F.cross_entropy(init(x), y)
    for b0, b1 in zip(block_layers(init), block_layers(model)):
        grads = torch.autograd.grad(loss, list(b0.params.values()), retain_graph=True)
        for p, p0, g in zip(b1.params.values(), b0.params.values(), grads):
            torch.testing.assert_close(p.detach(), p0.detach() - 0.5 * g, rtol=1e-5, atol=1e-6)


def test_reselection_happens_every_k_epochs():
    cb = LMSAStepper(update="optimizer", reselect_every_n_epochs=2)
    _trainer(cb, max_epochs=5).fit(BlockNet(n=16))
    assert [h["epoch"] for h in cb.history] == [0, 2, 4]
    assert all(h["step"] == 2 * h["epoch"] for h in cb.history)  # at the epoch's first batch
    cb = LMSAStepper(update="optimizer", selection_batches=2)
    _trainer(cb, max_epochs=3).fit(BlockNet(n=16))
    assert [(h["epoch"], h["step"]) for h in cb.history] == [(0, 1)]


def test_resume_continues_exactly(tmp_path):
    kw = dict(reselect_every_n_epochs=1, inner_lr=1e-2, rho_scale=2.0)
    full = BlockNet(n=16)
    cb_full = LMSAStepper(**kw)
    _trainer(cb_full, max_epochs=3).fit(full)

    part = BlockNet(n=16)
    cb1 = LMSAStepper(**kw)
    t1 = _trainer(cb1, max_epochs=2)
    t1.fit(part)
    ckpt = tmp_path / "a.ckpt"
    t1.save_checkpoint(ckpt)
    resumed = BlockNet(n=16)
    cb2 = LMSAStepper(**kw)
    _trainer(cb2, max_epochs=3).fit(resumed, ckpt_path=str(ckpt))
    assert cb2.history == cb_full.history and cb2.selected == cb_full.selected
    for (n, a), (_, b) in zip(full.named_parameters(), resumed.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
    sa, sb = cb_full._inner.state_dict()["state"], cb2._inner.state_dict()["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]) for k in sa)


def test_gradient_accumulation_rescales_costates():
    cb1 = LMSAStepper()
    _trainer(cb1, max_epochs=1).fit(BlockNet())
    cb2 = LMSAStepper()
    _trainer(cb2, max_epochs=1, accumulate_grad_batches=2).fit(BlockNet())
    for k in cb1.history[0]["scores"]:
        assert cb2.history[0]["scores"][k] == pytest.approx(cb1.history[0]["scores"][k], rel=1e-6)
    # 4 batches, 2 optimizer steps, 5 inner iterations each
    assert all(int(s["step"]) == 10 for s in cb2._inner.state_dict()["state"].values())


def test_user_blocks_and_loss_fn_on_a_flat_mlp():
    # without blocks=, the layers of the plain Sequential are the blocks: the input layer (the
    # stem, joined to the first) and the output layer (the head) apart
    found = LMSAStepper(loss_fn=toy_loss)
    _trainer(found, max_steps=1).fit(ToyMLP(d=16, width=16, n=16))
    assert found.block_names == ["net.0+net.2", "net.4", "net.6"] and set(found.scores) == set(found.block_names)
    model = ToyMLP(d=16, width=16, n=16)
    # issue 24: a module without loss(output, target) is measured on the loss its own
    # training_step returns (it was a TypeError asking for loss_fn): ToyMLP's training_step is
    # toy_loss, so the scores are the same as with loss_fn=toy_loss
    own = LMSAStepper(blocks=["net.0", "net.2", "net.4"])
    _trainer(own, max_steps=1).fit(model)
    model = ToyMLP(d=16, width=16, n=16)
    cb = LMSAStepper(blocks=["net.0", "net.2", "net.4"], loss_fn=toy_loss)
    _trainer(cb, max_steps=2).fit(model)
    assert set(cb.scores) == {"net.0", "net.2", "net.4", "net.6"} and len(cb.selected) == 1
    assert own.scores == pytest.approx(cb.history[0]["scores"], rel=1e-6)


def test_bad_input():
    for kw, match in [({"select": "max"}, "select"), ({"update": "adam"}, "update"),
                      ({"inner_optimizer": "lbfgs"}, "inner_optimizer"), ({"rho": 0}, "rho"),
                      ({"selection_batches": 0}, "selection_batches"), ({"reselect_every_n_epochs": 0}, "reselect"),
                      ({"rho_scale": -1.0}, "rho_scale"), ({"num_blocks": 1.5}, "num_blocks")]:
        with pytest.raises(ValueError, match=match):
            LMSAStepper(**kw)
    with pytest.raises(ValueError, match="matches no parameter"):
        _trainer(LMSAStepper(blocks=["nothing"]), max_steps=1).fit(BlockNet())
    with pytest.raises(ValueError, match="num_blocks"):
        _trainer(LMSAStepper(num_blocks=9), max_steps=1).fit(BlockNet())
    frozen = BlockNet()
    frozen.blocks[1].requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        _trainer(LMSAStepper(), max_steps=1).fit(frozen)
    with pytest.raises(RuntimeError, match="loss is nan"):
        _trainer(LMSAStepper(), max_steps=1).fit(NaNNet())


# ============================================================================ DDP


class DDPCheck(pl.Callback):
    def setup(self, trainer, pl_module, stage):
        torch.set_num_threads(1)  # in the spawned worker

    def on_train_start(self, trainer, pl_module):
        self.before = _blocks_of(pl_module)

    def on_train_epoch_end(self, trainer, pl_module):
        import torch.distributed as dist

        cb = next(c for c in trainer.callbacks if isinstance(c, LMSAStepper))
        assert trainer.world_size == 2 and len(cb.selected) == 1
        everyone = [None, None]
        dist.all_gather_object(everyone, (cb.selected, cb.scores, {n: p.detach().clone() for n, p in
                                                                  pl_module.named_parameters()}))
        (sel0, sc0, p0), (sel1, sc1, p1) = everyone
        assert sel0 == sel1 and sc0 == sc1
        for n in p0:
            assert torch.equal(p0[n], p1[n]), n
        after = _blocks_of(pl_module)
        for name in self.before:
            same = all(torch.equal(self.before[name][k], after[name][k]) for k in after[name])
            assert same == (name not in cb.selected), name
        pl_module.log("ddp_checked", 1.0)


class DDPNet(BlockNet):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("rank_loss", loss.detach(), sync_dist=False)
        return loss


@pytest.mark.parametrize("update", ["msa", "optimizer"])
def test_ddp_spawn_ranks_select_and_update_the_same_block(update):
    """Both update modes under DDP (the blocks kept out of DDP's buckets, update="optimizer"'s
    gradients averaged by hand): the ranks choose the same block and hold the same weights, and
    only the chosen block moved."""
    model = DDPNet(n=32)
    lmsa = LMSAStepper(inner_lr=1e-2) if update == "msa" else LMSAStepper(update="optimizer")
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=2, strategy=ddp_spawn(), logger=False,
                         callbacks=[lmsa, DDPCheck()], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(model)
    assert trainer.callback_metrics["ddp_checked"] == 1.0


class _HeldState(pl.Callback):
    """After each step: the parameters the module's optimizer holds state for."""

    def __init__(self, cb):
        self.cb, self.rows = cb, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        opt = trainer.optimizers[0]
        names = {id(p): n for n, p in pl_module.named_parameters()}
        self.rows.append((list(self.cb.selected), {names[id(p)] for p in opt.state}))


@pytest.mark.parametrize("state", ["release", "keep"])
def test_reselection_releases_the_optimizer_state_of_blocks_that_stop_training(state):
    """update="optimizer": the module's SGD holds momentum only for the selected blocks (and
    nothing else: every parameter is in a block); "keep" holds every block ever selected."""
    cb = LMSAStepper(update="optimizer", every_n_epochs=1, optimizer_state=state)
    rec = _HeldState(cb)
    model = BlockNet(n=16, seed=1)
    make_trainer([cb, rec], max_epochs=6).fit(model)
    picks = [tuple(n for n, v in h["selected"].items() if v > 0) for h in cb.history]
    assert len(set(picks)) > 1  # the choice changed at a re-selection
    blocks = {b.name: {f"{n}" for n in b.params} for b in block_layers(model)}
    ever: set[str] = set()
    before: list[str] = []  # the choice in effect during the batch's backward
    for selected, held in rec.rows:
        # save_compute: the selection batch's backward computed no gradient for a block the
        # previous choice did not hold, so a new choice first steps (and gets state) on the next batch
        stepped = {n for b in selected if b in before for n in blocks[b]}
        ever |= stepped
        assert held == (stepped if state == "release" else ever), (selected, sorted(held))
        before = list(selected)
    assert ever  # blocks did train


class _Grads(pl.Callback):
    """At each step, before the update: the blocks whose weights got a gradient in the backward."""

    def __init__(self, cb):
        self.cb, self.rows = cb, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        got = [b.name for b in self.cb.layers if any(p.grad is not None for p in b.params.values())]
        self.rows.append((trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1,
                          list(self.cb.selected), got))


@pytest.mark.parametrize("update", ["msa", "optimizer"])
def test_between_measurements_only_the_selected_blocks_get_weight_gradients(update):
    """save_compute (default): the backward computes weight gradients only for what the module's
    optimizer trains -- the blocks selected before the batch with update="optimizer" (on the
    measurement batches too: the metric reads states and co-states only), none with
    update="msa" (its Hamiltonian step reads the captures); save_compute=False: all, always."""
    for save in (True, False):
        cb = LMSAStepper(update=update, every_n_epochs=2, save_compute=save)
        rec = _Grads(cb)
        make_trainer([cb, rec], max_epochs=3).fit(BlockNet(n=24, seed=2))
        names = cb.block_names
        before: list[str] = []
        for epoch, batch, selected, got in rec.rows:
            if not save:
                want = names
            elif update == "msa":
                want = []
            else:
                want = [n for n in names if n in before]
            assert got == want, (save, epoch, batch, selected, got)
            before = selected
        assert len(cb.history) == 2 and rec.rows[-1][2]  # two selections were made, and one trains
        assert LMSAStepper(save_compute=save).settings()["save_compute"] is save


# ============================================================================ save_compute on every family


def _lm_loss(pl_module, batch):
    return pl_module.model(input_ids=batch[0], labels=batch[0]).loss


class InplaceMLP(pl.LightningModule):
    """A user's ``Sequential`` trunk with ``ReLU(inplace=True)`` after each Linear: the first
    block's output needs no gradient on a measurement batch with every weight frozen, and is then
    modified in place -- the co-state path must allow that."""

    def __init__(self, d=8, w=16, classes=3):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(d, w), nn.ReLU(inplace=True), nn.Linear(w, w), nn.ReLU(inplace=True),
                                   nn.Linear(w, w), nn.ReLU(inplace=True), nn.Linear(w, w))
        self.classifier = nn.Linear(w, classes)

    def forward(self, x):
        return self.classifier(self.trunk(x))

    def loss(self, out, y):
        return F.cross_entropy(out, y)

    def training_step(self, batch, _):
        x, y = batch
        return self.loss(self(x), y)

    def train_dataloader(self):
        return DataLoader(make_data(32, 8, 3), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _family(case):
    from tests._lm import lm_module
    from tests.test_plain_models import PlainCNN

    if case == "plain-mlp-inplace":
        return InplaceMLP(), {}
    if case == "plain-cnn":
        return PlainCNN(), {}
    family, tied = case.split("-")
    return lm_module(family, tied == "tied", seed=1, lr=0.05), {"loss_fn": _lm_loss}


@pytest.mark.parametrize("update", ["msa", "optimizer"])
@pytest.mark.parametrize("case", ["llama-untied", "llama-tied", "gpt2-tied", "opt-tied", "plain-mlp-inplace",
                                  "plain-cnn"])
def test_measurement_batches_compute_no_frozen_weight_gradient_and_the_same_metric(case, update):
    """save_compute: on every family, measurement batches included, the backward computes weight
    gradients only for what the module's optimizer trains (the choice in effect with
    update="optimizer", nothing with update="msa"), and the metric equals that of
    save_compute=False, which computes every gradient; with update="msa" the whole run is the same."""
    runs = {}
    for save in (True, False):
        model, kw = _family(case)
        inner = {"inner_lr": 1e-2} if update == "msa" else {}
        cb = LMSAStepper(update=update, every_n_epochs=1, save_compute=save, **inner, **kw)
        rec = _Grads(cb)
        make_trainer([cb, rec], max_epochs=2).fit(model)
        runs[save] = cb, rec, model
    (cb, rec, model), (ref, ref_rec, ref_model) = runs[True], runs[False]
    assert len(cb.history) == 2
    first, want = cb.history[0], ref.history[0]
    assert first["selected"] == want["selected"]
    for key in ("scores", "rho_hat", "rgn"):
        for name in cb.block_names:
            assert first[key][name] == pytest.approx(want[key][name], rel=1e-5, abs=1e-9), (key, name)
    before: list[str] = []
    for epoch, batch, selected, got in rec.rows:
        assert got == ([n for n in cb.block_names if n in before] if update == "optimizer" else []), (epoch, batch)
        before = selected
    assert all(got == ref.block_names for *_, got in ref_rec.rows)  # save_compute=False: every block
    if update == "msa":
        assert cb.history == ref.history
        for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=n)


def test_blocks_that_do_not_run_in_order_are_refused_in_one_line():
    """A block whose modules run on both sides of another block (here the stem joined to a norm
    that runs last, as OPT's registration order once gave) cannot be a state-to-state map."""

    class Late(BlockNet):
        def __init__(self):
            super().__init__()
            self.final = nn.LayerNorm(8)

        def forward(self, x):
            x = torch.relu(self.stem(x))
            for b in self.blocks:
                x = b(x)
            return self.fc(self.final(x))

    cb = LMSAStepper(blocks=[["stem", "final"], "blocks.0", "blocks.1", "blocks.2"])
    with pytest.raises(RuntimeError, match=r"finishes after block .* starts .* Pass blocks=\[\.\.\.\]"):
        _trainer(cb, max_steps=1).fit(Late())
