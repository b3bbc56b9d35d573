"""lalr_lightning.core.linearization.proximal: the selective decision, the decoupled step, Theorem 1 (seeds/001)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lalr_lightning.core.linearization.proximal import (
    GRANULARITIES,
    deltas,
    distances,
    inner_products,
    proximal_step_,
    pull_decisions,
)


def hand_built():
    """<g_a, d_a> = +3, <g_b, d_b> = -5 (layer L1 = {a, b}: -2), <g_c, d_c> = +4 (layer L2); total +2."""
    grads = {"a": torch.ones(3), "b": torch.tensor([1.0, 2.0]), "c": torch.tensor([[2.0]])}
    dl = {"a": torch.ones(3), "b": torch.tensor([-1.0, -2.0]), "c": torch.tensor([[2.0]])}
    return grads, dl, {"L1": ["a", "b"], "L2": ["c"]}


def test_three_granularities_disagree_as_documented():
    grads, dl, groups = hand_built()
    assert inner_products(grads, dl) == {"a": 3.0, "b": -5.0, "c": 4.0}
    assert pull_decisions(grads, dl, "tensor") == {"a": True, "b": False, "c": True}
    assert pull_decisions(grads, dl, "layer", groups) == {"a": False, "b": False, "c": True}
    assert pull_decisions(grads, dl, "global") == {"a": True, "b": True, "c": True}
    for g in GRANULARITIES:  # plain L2-SP: always
        assert pull_decisions(grads, dl, g, groups, selective=False) == {"a": True, "b": True, "c": True}
    # the global sum flips when b's product drops below -7
    dl["b"] = torch.tensor([-4.0, -2.0])
    assert pull_decisions(grads, dl, "global") == dict.fromkeys("abc", False)


def test_zero_and_missing_gradients_count_as_zero_and_pull():
    grads, dl, groups = hand_built()
    grads["a"] = torch.zeros(3)
    grads["c"] = None
    assert pull_decisions(grads, dl, "tensor") == {"a": True, "b": False, "c": True}
    del grads["c"]
    assert inner_products(grads, dl)["c"] == 0.0


def test_low_precision_inner_products_are_accumulated_in_float32():
    # 4096 products of 1e-2 * 1e-2 (= 0.4096 in exact arithmetic); bf16 accumulation would lose the sum
    g = torch.full((4096,), 1e-2, dtype=torch.bfloat16)
    ip = inner_products({"w": g}, {"w": g.clone()})["w"]
    assert ip == pytest.approx(4096 * float(g[0]) ** 2, rel=1e-3)


def test_proximal_step_equals_the_formula_per_parameter():
    torch.manual_seed(0)
    params = {"a": torch.randn(4, 3), "b": torch.randn(5), "c": torch.randn(2, 2, dtype=torch.float64)}
    anchors = {k: v + 0.1 * torch.randn_like(v) for k, v in params.items()}
    before = {k: v.clone() for k, v in params.items()}
    lrs = {"a": 0.1, "b": 0.02, "c": 0.3}
    coef = proximal_step_(params, anchors, 2.0, lrs, {"a": True, "b": True, "c": False})
    assert coef == {"a": pytest.approx(0.2), "b": pytest.approx(0.04), "c": 0.0}
    for k in ("a", "b"):
        expected = before[k] - 2.0 * lrs[k] * (before[k] - anchors[k])
        torch.testing.assert_close(params[k], expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(params["c"], before["c"])  # not pulled: untouched bitwise
    # one learning rate for all, every tensor pulled; the anchor in another dtype is cast
    p = {"w": torch.tensor([1.0, -2.0, 4.0])}
    proximal_step_(p, {"w": torch.tensor([0.0, 0.0, 2.0], dtype=torch.float64)}, 0.5, 0.4)
    torch.testing.assert_close(p["w"], torch.tensor([0.8, -1.6, 3.6]))


def test_deltas():
    params = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[3.0]])}
    out = deltas(params, {"a": torch.tensor([0.5, 2.5]), "b": torch.tensor([[1.0]], dtype=torch.float64)})
    torch.testing.assert_close(out["a"], torch.tensor([0.5, -0.5]))
    assert out["b"].dtype == torch.float32 and float(out["b"]) == 2.0


def test_distances_per_tensor_layer_and_total():
    _, dl, groups = hand_built()
    assert distances(dl) == {"a": pytest.approx(3**0.5), "b": pytest.approx(5**0.5), "c": 2.0}
    assert distances(dl, groups) == {"L1": pytest.approx(8**0.5), "L2": 2.0}
    assert distances(dl, {"all": list(dl)})["all"] == pytest.approx(12**0.5)


def test_bad_input_errors():
    grads, dl, groups = hand_built()
    with pytest.raises(ValueError, match="valid: 'tensor', 'layer', 'global'"):
        pull_decisions(grads, dl, "layers")
    with pytest.raises(ValueError, match="needs groups"):
        pull_decisions(grads, dl, "layer")
    with pytest.raises(ValueError, match="'c' is in no layer"):
        pull_decisions(grads, dl, "layer", {"L1": ["a", "b"]})
    params = {"w": torch.ones(2)}
    for lam in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="lam must be"):
            proximal_step_(params, {"w": torch.zeros(2)}, lam, 0.1)
    with pytest.raises(ValueError, match="overshoot"):
        proximal_step_(params, {"w": torch.zeros(2)}, 50.0, 0.1)
    with pytest.raises(ValueError, match="anchors has no value for 'w'"):
        proximal_step_(params, {}, 1.0, 0.1)
    with pytest.raises(ValueError, match="lrs has no entry for 'w'"):
        proximal_step_(params, {"w": torch.zeros(2)}, 1.0, {})
    with pytest.raises(ValueError, match="shape"):
        proximal_step_(params, {"w": torch.zeros(3)}, 1.0, 0.1)


def gd_with_proximal_step(selective: bool, granularity: str = "global", lam: float = 2.0, lr: float = 0.02,
                          steps: int = 200) -> torch.Tensor:
    """Full-batch gradient descent on R~ = ||f(x*) - y*||^2, the proximal step after each step.

    The paper's split scheme: theta~ = theta - lr grad R~(theta), then theta~ - lam lr (theta~ - theta_0)
    where <grad R~(theta), theta~ - theta_0> >= 0 (selective) or always (plain L2-SP). Returns the
    training loss before each step and after the last (steps + 1 values).
    """
    torch.manual_seed(5)
    f64 = torch.float64
    model = nn.Sequential(nn.Linear(4, 4, dtype=f64), nn.Tanh(), nn.Linear(4, 1, dtype=f64))
    teacher = nn.Sequential(nn.Linear(4, 32, dtype=f64), nn.Tanh(), nn.Linear(32, 1, dtype=f64))
    x = torch.randn(32, 4, dtype=f64)
    y = 3 * teacher(x).detach()
    params = dict(model.named_parameters())
    anchor = {k: v.detach().clone() for k, v in params.items()}  # the "pretrained" theta_0
    groups = {"0": ["0.weight", "0.bias"], "2": ["2.weight", "2.bias"]}
    losses = []
    for _ in range(steps):
        loss = ((model(x) - y) ** 2).sum()
        losses.append(loss.item())
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
        with torch.no_grad():
            for k, p in params.items():
                p.sub_(lr * grads[k])
        pull = pull_decisions(grads, deltas(params, anchor), granularity, groups, selective=selective)
        proximal_step_(params, anchor, lam, lr, pull)
    with torch.no_grad():
        losses.append(((model(x) - y) ** 2).sum().item())
    return torch.tensor(losses, dtype=f64)


def test_theorem1_selective_step_never_increases_the_training_loss():
    selective = gd_with_proximal_step(selective=True)
    plain = gd_with_proximal_step(selective=False)
    assert selective[0] == plain[0]  # the same run set-up
    # Theorem 1: with the selective pull the squared loss is non-increasing at every one of the 200 steps
    assert torch.all(selective.diff() < 0), selective.diff().max()
    # plain L2-SP at the same lambda pulls against the descent direction and raises it on some steps
    rises = plain.diff() > 0
    assert rises.sum() >= 10 and plain.diff().max() > 1e-3 * plain[1:].min()
    assert selective[-1] < plain[-1]


@pytest.mark.parametrize("path", ["kept", "stacked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("granularity", ["tensor", "layer", "global", "l2sp"])
def test_grouped_step_is_the_per_tensor_step_bitwise(dtype, granularity, path, monkeypatch):
    """GroupedStep (the callback's foreach step, decisions on the device) gives pull_decisions +
    proximal_step_'s numbers bitwise, with a different lam * lr per tensor and a missing gradient;
    on both of its paths (``kept``: the CPU's product buffer kept between steps; ``stacked``: the
    accelerators' temporaries), with runs of equal-shape tensors summed as one matrix, a run cut
    into chunks, and shapes of one size but another shape kept apart."""
    from lalr_lightning.core.linearization.proximal import GroupedStep, deltas, proximal_step_, pull_decisions

    monkeypatch.setattr(GroupedStep, "KEEP", path == "kept")
    monkeypatch.setattr(GroupedStep, "CHUNK", 64)  # the three (4, 6) below: two chunks
    g = torch.Generator().manual_seed(7)
    shapes = [(6, 5), (6,), (4, 6), (4,), (3, 4), (3,), (4, 6), (6, 4), (24,), (4, 6), (6,)]
    names = [f"t{i}" for i in range(len(shapes))]
    params = {n: torch.randn(*s, generator=g).to(dtype) for n, s in zip(names, shapes)}
    anchors = {n: torch.randn(*s, generator=g).to(dtype) for n, s in zip(names, shapes)}
    grads = {n: torch.randn(*s, generator=g).to(dtype) for n, s in zip(names, shapes)}
    grads["t3"] = None
    layers = {"a": names[:2], "b": names[2:4], "c": names[4:6], "d": names[6:]}
    lrs = {n: 0.01 * (i + 1) for i, n in enumerate(names)}
    selective = granularity != "l2sp"
    gran = granularity if selective else "tensor"
    want = {n: p.clone() for n, p in params.items()}
    pull = pull_decisions(grads, deltas(want, anchors), gran, layers, selective=selective)
    proximal_step_(want, anchors, 0.7, lrs, pull)
    got = [p.clone() for p in params.values()]
    step = GroupedStep(got, [0, 0, 1, 1, 2, 2, 3, 3, 3, 3, 3])
    coefs = [0.7 * lrs[n] for n in names]
    decided = step.step_(got, list(anchors.values()), list(grads.values()), coefs, selective=selective,
                         granularity=gran)
    assert [bool(decided[step.order.index(i)]) for i in range(len(names))] == [pull[n] for n in names]
    for n, t in zip(names, got):
        assert torch.equal(t, want[n]), n
    # a second step with the same plan (its buffers and views reused) is again the per-tensor step
    grads = {n: None if v is None else -v for n, v in grads.items()}
    pull = pull_decisions(grads, deltas(want, anchors), gran, layers, selective=selective)
    proximal_step_(want, anchors, 0.7, lrs, pull)
    decided = step.step_(got, list(anchors.values()), list(grads.values()), coefs, selective=selective,
                         granularity=gran)
    assert [bool(decided[step.order.index(i)]) for i in range(len(names))] == [pull[n] for n in names]
    for n, t in zip(names, got):
        assert torch.equal(t, want[n]), n
    assert 0 < sum(pull.values()) < len(names) or granularity in ("global", "l2sp")


# ----------------------------------------------------------------------------- helpers the callback uses


def test_grouped_step_counts_its_steps_and_pulls_until_taken():
    from lalr_lightning.core.linearization.proximal import GroupedStep

    params = [torch.ones(2), torch.ones(3, dtype=torch.float64), torch.ones(1)]  # two dtype groups: order != input
    anchors = [torch.zeros_like(p) for p in params]
    grads = [torch.ones(2), -torch.ones(3, dtype=torch.float64), torch.ones(1)]  # <g, d>: +, -, +
    plan = GroupedStep(params, [0, 1, 2])
    assert plan.order != [0, 1, 2]
    for _ in range(3):
        plan.step_(params, anchors, grads, [0.0, 0.0, 0.0])  # coefficient 0: the weights stay, the counts grow
    assert plan.take() == (3, [3, 0, 3]) and plan.take() == (0, [0, 0, 0])  # read once, then from zero
    plan.step_(params, anchors, grads, [0.0] * 3, selective=False)
    assert plan.take() == (1, [1, 1, 1])


def test_selective_step_and_pulled_fractions():
    from lalr_lightning.core.linearization.proximal import pulled_fractions, selective_step_

    grads, dl, groups = hand_built()  # layer L1 = {a, b}: -2 (kept), L2 = {c}: +4 (pulled)
    params = {n: d.clone() for n, d in dl.items()}  # theta_0 = 0, so theta - theta_0 = dl
    anchors = {n: torch.zeros_like(d) for n, d in dl.items()}
    # groups are cut to the stepped tensors: without "b", layer L1's sum is +3 and it is pulled
    pull = selective_step_({n: params[n] for n in "ac"}, anchors, grads, 1.0, 0.5, granularity="layer",
                           groups=groups)
    assert pull == {"a": True, "c": True} and torch.equal(params["a"], 0.5 * dl["a"])
    assert torch.equal(params["b"], dl["b"])
    pull = selective_step_(params, anchors, grads, 1.0, 0.5, granularity="layer", groups=groups)
    assert pull == {"a": False, "b": False, "c": True}
    assert selective_step_(params, anchors, {}, 1.0, 0.5, selective=False) == dict.fromkeys("abc", True)
    assert pulled_fractions({"a": 4, "b": 4, "c": 2, "d": 0}, {"a": 1, "b": 3, "c": 2, "d": 0},
                            {"L1": ["a", "b"], "L2": ["c"], "L3": ["d"]}) == {"L1": 0.5, "L2": 1.0, "L3": 0.0}


def test_grouped_step_coefficients_are_checked_and_kept_while_the_learning_rates_are():
    from lalr_lightning.core.linearization.proximal import GroupedStep

    plan = GroupedStep([torch.ones(2), torch.ones(1)])
    token, calls = object(), []

    def lrs():
        calls.append(1)
        return {"w": 0.1, "b": 0.2}

    assert plan.coefficients(2.0, token, lrs) == pytest.approx([0.2, 0.4])
    assert plan.coefficients(2.0, token, lrs) == pytest.approx([0.2, 0.4]) and len(calls) == 1  # same LRs: kept
    with pytest.raises(ValueError, match=r"lam \* lr = 20.0 \* 0.1 = 2 > 1 for 'w'"):
        plan.coefficients(20.0, object(), lrs)


def test_stepped_tensors_and_the_ranks_agreement():
    from lalr_lightning.core.linearization.proximal import stepped

    a, b, c = (nn.Parameter(torch.zeros(2)) for _ in range(3))
    a.grad, c.grad = torch.ones(2), torch.ones(2)
    params = {"a": a, "b": b, "c": c}
    assert stepped(params) == ["a", "c"] and stepped({}) == [] and stepped({}, reduce=lambda t: t) == []
    # another rank held a gradient of b: the sum over the ranks says b stepped too
    assert stepped(params, reduce=lambda t: t + torch.tensor([0.0, 1.0, 0.0])) == ["a", "b", "c"]
    assert stepped(params, reduce=lambda t: t) == ["a", "c"]


def test_the_anchor_argument_is_fit_start_or_a_path():
    from pathlib import Path

    from lalr_lightning.core.linearization.anchor import check_anchor_arg

    assert check_anchor_arg("fit_start") == "fit_start" and check_anchor_arg(Path("/a/b.ckpt")) == "/a/b.ckpt"
    for bad in ("", None, 3):
        with pytest.raises(ValueError, match="anchor must be 'fit_start' or the path of a checkpoint / state dict, got"):
            check_anchor_arg(bad)


def test_grouped_step_adopts_the_anchor_on_a_cpu():
    """On a CPU the step stacks theta_0 for its sums; adopt() hands back views of that copy (bitwise
    the anchors, one storage), and the step through them is still the per-tensor step bitwise."""
    from lalr_lightning.core.linearization.proximal import GroupedStep, deltas, proximal_step_, pull_decisions

    g = torch.Generator().manual_seed(3)
    shapes = [(5, 4), (4,), (5, 4), (4,), (2, 3)]
    params = [torch.randn(*s, generator=g) for s in shapes] + [torch.randn(3, generator=g).to(torch.bfloat16)]
    anchors = [p + 0.1 * torch.randn(p.shape, generator=g).to(p.dtype) for p in params]
    grads = [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]
    plan = GroupedStep(params)
    held = plan.adopt(anchors)
    assert all(torch.equal(h, a) and h.shape == a.shape and h.dtype == a.dtype for h, a in zip(held, anchors))
    # float32: views of one stacked copy (one storage per run of equal shapes), nothing more
    storages = {h.untyped_storage().data_ptr(): h.untyped_storage().nbytes() for h in held[:5]}
    assert all(h._base is not None for h in held[:5]) and len(storages) == 3
    assert sum(storages.values()) == 4 * sum(a.numel() for a in anchors[:5])
    assert held[5] is anchors[5]  # bf16 keeps the grouped ops on the anchors themselves
    names = [f"t{i}" for i in range(len(params))]
    want = {n: p.clone() for n, p in zip(names, params)}
    an = dict(zip(names, anchors))
    lrs = {n: 0.05 for n in names}
    for sign in (1, -1):  # two steps through the adopted views
        gr = {n: sign * x for n, x in zip(names, grads)}
        pull = pull_decisions(gr, deltas(want, an), "tensor")
        proximal_step_(want, an, 1.0, lrs, pull)
        decided = plan.step_(params, held, list(gr.values()), [0.05] * len(names))
        assert [bool(decided[plan.order.index(i)]) for i in range(len(names))] == [pull[n] for n in names]
        assert all(torch.equal(p, want[n]) for n, p in zip(names, params))
