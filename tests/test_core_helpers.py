"""The pure helpers the L-MSA, HT-SR pruning, LALR and TempBalance callbacks call in core/: each
against a hand computation or the error it must give."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from lalr_lightning.core.model.blocks import block_layers
from lalr_lightning.core.model.layers import matrix_layers
from lalr_lightning.core.model.taps import BlockTaps
from lalr_lightning.core.pruning import alphapruning as ap
from lalr_lightning.core.pruning import by_criterion as bc
from lalr_lightning.core.selection import msa
from lalr_lightning.core.selection.msa_settings import check_blocks, check_restored, lmsa_settings, sharded_refusal
from lalr_lightning.core.spectral import tempbalance as tb
from lalr_lightning.core.spectral.lalr_metrics import lalr_layers
from lalr_lightning.core.spectral.settings import lalr_layer_checks, lalr_settings, tempbalance_settings
from tests._toys import DeepLinear

# ============================================================================ L-MSA


def test_hamiltonian_terms_give_the_hamiltonian_of_the_captured_step():
    """At the anchor, H = sum_n p_{n+1} . x_{n+1} (the proximal term is zero), one term per
    block and micro-batch, each weighted 1 / micro-batches."""
    model = DeepLinear()
    x = torch.randn(7, 5, dtype=torch.float64)
    y = torch.randn(7, 3, dtype=torch.float64)

    def run():
        return 0.5 * (model(x) - y).square().sum()

    layers = block_layers(model)
    names = [b.name for b in layers]
    taps = BlockTaps(model, layers)
    taps.discover(run)
    assert msa.hamiltonian_terms(taps, names, lambda context: run()) is None  # nothing captured yet
    assert msa.hamiltonian_terms(taps, [], lambda context: run()) is None
    taps.set_capture(names)
    run().backward()
    params, terms, finite = msa.hamiltonian_terms(taps, names[1:], lambda context: run())
    assert [id(p) for p in params] == [id(p) for n in names[1:] for p in taps.theta(n)]
    assert [t.index for t in terms] == [[0], [1]] and [t.weight for t in terms] == [1.0, 1.0]
    assert [n for n, _ in finite] == names[1:] and all(bool(f) for _, f in finite)
    want = sum((taps.captures[n][0].p * taps.captures[n][0].out).sum() for n in names[1:])
    got = msa.hamiltonian(terms, [p.detach() for p in params], [p.detach() for p in params], rho=1.0)
    torch.testing.assert_close(got, want.detach())


def test_choose_blocks_and_the_all_diverged_error():
    scores = {"a": 3.0, "b": 1.0, "c": 2.0}
    assert msa.choose_blocks(scores, "min", 2) == ["b", "c"]
    assert msa.choose_blocks(scores, "all") == ["a", "b", "c"]
    assert msa.choose_blocks({"a": math.inf, "b": 5.0}, "min") == ["b"]
    with pytest.raises(RuntimeError, match="every block's one-step update diverged"):
        msa.choose_blocks({"a": math.inf, "b": math.nan}, "min")


def test_nonfinite_blocks_reads_the_flags_once():
    flags = [("a", torch.tensor(True)), ("b", torch.tensor(False)), ("a", torch.tensor(False))]
    assert msa.nonfinite_blocks(flags) == ["a", "b"]
    assert msa.nonfinite_blocks([("a", torch.tensor(True))]) == []
    assert msa.nonfinite_blocks([]) == []


def test_mean_flat_keeps_every_shape():
    grads = [torch.arange(6.0).view(2, 3), torch.tensor([1.0, 3.0]), torch.tensor(5.0)]
    calls = []

    def mean(flat):
        calls.append(flat.shape)
        return flat / 2

    out = msa.mean_flat(grads, mean)
    assert calls == [torch.Size([9])]  # one collective for all the tensors
    for o, g in zip(out, grads):
        assert o.shape == g.shape
        torch.testing.assert_close(o, g / 2)


def test_inner_optimizer_by_name_or_callable():
    params = [nn.Parameter(torch.zeros(2))]
    adam = msa.inner_optimizer("adam", params, 0.01)
    sgd = msa.inner_optimizer("sgd", params, 0.5)
    assert isinstance(adam, torch.optim.Adam) and adam.param_groups[0]["lr"] == 0.01
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["lr"] == 0.5
    mine = msa.inner_optimizer(lambda ps: torch.optim.RMSprop(ps, lr=0.2), params, 0.01)
    assert isinstance(mine, torch.optim.RMSprop) and mine.param_groups[0]["lr"] == 0.2


def test_measurement_cost_says_what_helps_over_the_limit():
    sizes = {"a": 2**20, "head": 3 * 2**20}
    text, over = msa.measurement_cost(sizes, 2, limit=8 * 2**20)
    assert not over and "2 blocks, about 4 MiB" in text and "'head', 3 MiB" in text and "n_batches=2" in text
    text, over = msa.measurement_cost(sizes, 1, limit=2**20, head="head")
    assert over and text.endswith("out of the measurement") and "head=False" in text
    text, over = msa.measurement_cost(sizes, 1, limit=2**20, head="a")
    assert over and text.endswith("a smaller batch holds less")


def test_check_blocks():
    assert check_blocks({"a": True, "b": True}, "min", 1) is None
    assert "cannot choose" in check_blocks({"a": True, "b": True}, "min", 2)
    assert check_blocks({"a": True, "b": True}, "all", 1) is None
    with pytest.raises(ValueError, match="block 'b' has no parameter that requires grad"):
        check_blocks({"a": True, "b": False}, "min", 1)
    with pytest.raises(ValueError, match="num_blocks=3 but the model has 2 blocks"):
        check_blocks({"a": True, "b": True}, "min", 3)


def test_sharded_refusal_and_restored_blocks():
    assert sharded_refusal("optimizer") is None
    assert "pass update='optimizer'" in sharded_refusal("msa") and "strategy='ddp'" in sharded_refusal("msa")
    check_restored(["b"], ["a", "b"])
    check_restored([], [])
    with pytest.raises(ValueError, match=r"the checkpoint selected blocks \['c'\] that this model does not have "
                                         r"\(blocks: \['a', 'b'\]\)"):
        check_restored(["a", "c"], ("a", "b"))


def _lmsa(**kw):
    args = dict(select="min", num_blocks=None, update="msa", rho=None, inner_optimizer=None, inner_lr=None,
                inner_steps=None, feasibility=None, rho_scale=None, metric_rho=None, output_dim=None, n_batches=1,
                every_n_epochs=None, head=True, loss_fn=None, seed=0)
    return lmsa_settings(**{**args, **kw})


def test_lmsa_settings_check_the_modes():
    assert _lmsa()["rho"] == 1.0 and _lmsa()["inner_optimizer"] == "adam" and _lmsa()["inner_steps"] == 5
    with pytest.raises(ValueError, match="select"):
        _lmsa(select="max")
    with pytest.raises(ValueError, match=r"LMSAStepper\(update='optimizer'\) does not use inner_lr"):
        _lmsa(update="optimizer", inner_lr=1e-3)
    with pytest.raises(ValueError, match=r"LMSAStepper\(select='all'\) does not use num_blocks"):
        _lmsa(select="all", num_blocks=2)
    with pytest.raises(ValueError, match="give one of them"):
        _lmsa(metric_rho=1.0, rho_scale=2.0)


# ============================================================================ pruning


class _WithAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2)
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(self.attn(x, x, x)[0])


def test_readable_layers_leave_out_what_a_row_criterion_cannot_hook():
    layers = matrix_layers(_WithAttention())
    names = [la.name for la in layers]
    kept, out = bc.readable_layers(layers, "magnitude", 0, 0)
    assert [la.name for la in kept] == names and out == {}
    kept, out = bc.readable_layers(layers, "wanda", 0, 0)
    assert [la.name for la in kept] == ["fc"] and list(out) == [n for n in names if n != "fc"]
    assert all("criterion='wanda' cannot read" in why for why in out.values())
    _, out = bc.readable_layers(layers, "magnitude", 2, 4)
    assert all("(n=2, m=4)" in why for why in out.values()) and out
    with pytest.raises(ValueError, match="has no layer left to prune"):
        bc.readable_layers([la for la in layers if la.name != "fc"], "sparsegpt", 0, 0)


def test_calibration_forward_runs_the_inputs_or_names_the_fix():
    seen = []
    model = nn.Linear(3, 2)
    model.register_forward_hook(lambda m, i, o: seen.append(i[0].shape))
    bc.calibration_forward(model, (torch.randn(4, 3), torch.zeros(4)), "wanda")
    assert seen == [torch.Size([4, 3])]
    with pytest.raises(ValueError, match=r"criterion='wanda'\) could not run Linear on a calibration batch"):
        bc.calibration_forward(model, (torch.randn(4, 5), torch.zeros(4)), "wanda")


def test_dense_note_and_finite_metric():
    assert ap.dense_note({"fc": "classifier head (head=False)"}) is None
    note = ap.dense_note({"fc": "classifier head (head=False)", "c1": "9 weights < min_numel=512"})
    assert note == "HTSRPruning leaves these layers dense: c1 (9 weights < min_numel=512). Lower min_numel / " \
                   "min_evals to include them."
    assert list(ap.finite_metric({"b": 2.0, "a": 1.0}, ["a", "b"], "alpha")) == ["a", "b"]
    with pytest.raises(ValueError, match=r"metric 'alpha' is not finite for layers \{'b': nan, 'c': None\}"):
        ap.finite_metric({"a": 1.0, "b": math.nan}, ["a", "b", "c"], "alpha")


def test_check_known_masks():
    ap.check_known_masks({"fc.weight": None}, {"fc.weight": None, "fc.bias": None})
    ap.check_known_masks({}, {})
    with pytest.raises(RuntimeError, match=r"prunable layers lack: \['a.weight', 'b.weight'\]; the checkpoint"):
        ap.check_known_masks({"b.weight": 1, "a.weight": 1, "fc.weight": 1}, {"fc.weight": None})


def test_calibration_samples_take_the_given_data_else_the_loader():
    data = [torch.zeros(3, 4), torch.ones(3, 4)]
    got = bc.calibration_samples(data, None, 4, "criterion='wanda'")
    assert bc.sample_count(got) == 4 and torch.equal(got[1], torch.ones(1, 4))
    asked = []
    got = bc.calibration_samples(None, lambda: asked.append(1) or data, 2, "criterion='wanda'")
    assert asked == [1] and bc.sample_count(got) == 2  # the loader only when nothing was given
    with pytest.warns(UserWarning, match=r"HTSRPruning\(preset='owl'\) calibrates on 6 samples, all the calibration "
                                         "data has; n_calibration=8 asked for more"):
        assert bc.sample_count(bc.calibration_samples(data, None, 8, "preset='owl'")) == 6
    with pytest.raises(ValueError, match=r"plan\(\) has no fit to take it from; pass calibration="):
        bc.calibration_samples(None, None, 2, "criterion='wanda'")
    with pytest.raises(ValueError, match="the fit has no training loader; pass calibration="):
        bc.calibration_samples(None, lambda: None, 2, "criterion='wanda'")


def test_layer_metric_is_the_esd_of_each_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 10))
    layers = matrix_layers(model)
    for metric, of in (("norm", lambda w: w.square().sum()), ("spectral_norm", lambda w: torch.linalg.svdvals(w)[0] ** 2)):
        got = ap.layer_metric(layers, metric, fit="ks", filter_zeros=False)
        assert list(got) == [la.name for la in layers]
        for la in layers:
            assert got[la.name] == pytest.approx(float(of(la.weight.detach().double())), rel=1e-5)


# ============================================================================ LALR and TempBalance


def _lalr(**kw):
    args = dict(phases=None, mode="sequential", floor=0.1, weights=None, hessian_delta=None, groups="shape",
                bins=None, hist_range=None, eps=1e-12, singleton_value=None, layer_types=("linear",),
                trainable_only=True)
    return lalr_settings("LALRScheduleCallback", **{**args, **kw})


def test_lalr_settings_fill_the_defaults_and_refuse_what_does_not_go():
    s = _lalr()
    assert s["phases"] == ("svd", "ce", "cs") and s["hessian_delta"] == 0.1 and s["bins"] == 64
    assert s["singleton_value"] == 0.5 and s["weights"] is None and s["layer_types"] == ("linear",)
    assert _lalr(mode="weighted")["weights"] == {"svd": 1.0, "ce": 1.0, "cs": 1.0}
    assert _lalr(phases="ce")["phases"] == ("ce",)
    for kw, match in ((dict(mode="x"), "mode"), (dict(floor=2.0), "floor must be in"),
                      (dict(phases=[]), "phases is empty"), (dict(phases=["svd", "xx"]), r"unknown phase name\(s\)"),
                      (dict(weights={"ce": 1.0}), "weights only apply to mode='weighted'"),
                      (dict(groups="shape", bins=8), r"LALRScheduleCallback\(groups='shape'\) does not use bins"),
                      (dict(hessian_delta=0.0, mode="hessian"), "hessian_delta must be in")):
        with pytest.raises(ValueError, match=match):
            _lalr(**kw)


def test_lalr_layer_checks():
    one = lalr_layers(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="needs at least 2 weight matrices that train; M has only '0'"):
        lalr_layer_checks("L", "M", one, layer_types=("linear",), trainable_only=True, groups="shape",
                          singleton_value=0.5)
    odd = lalr_layers(nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 7)))
    note = lalr_layer_checks("L", "M", odd, layer_types=("linear",), trainable_only=True, groups="shape",
                             singleton_value=0.5)
    assert note.startswith("L(groups='shape'): 3 of 5 layers have no same-shaped peer and get ce = cs = 0.5 (0, 1, 4)")
    assert lalr_layer_checks("L", "M", odd, layer_types=("linear",), trainable_only=True, groups="histogram",
                             singleton_value=0.5) is None


def _tb(**kw):
    args = dict(assign="linear_map", fit="median", lr_min_ratio=None, lr_max_ratio=None, every_n_epochs=1,
                every_n_steps=None, first=False, head=False, min_evals=50, layer_types=("linear",),
                filter_zeros=False, std=None, seed=0)
    return tempbalance_settings("TempBalanceCallback", **{**args, **kw})


def test_tempbalance_settings():
    s = _tb()
    assert (s["lr_min_ratio"], s["lr_max_ratio"], s["std"]) == (0.5, 1.5, 1.0)
    for kw, match in ((dict(assign="x"), "assign"), (dict(min_evals=1), "min_evals must be an integer >= 2"),
                      (dict(lr_min_ratio=2.0), "need 0 <= lr_min_ratio <= lr_max_ratio"),
                      (dict(every_n_steps=0), "every_n_epochs and every_n_steps must be >= 1"),
                      (dict(first="yes"), "first must be False .*, True .* or 'block'"),
                      (dict(std=2.0), r"TempBalanceCallback\(assign='linear_map'\) does not use std")):
        with pytest.raises(ValueError, match=match):
            _tb(**kw)
    # one check of ``first``, whoever asks: the pure layer choice says the same
    with pytest.raises(ValueError, match="first must be False .*, True .* or 'block'"):
        tb.eligible_layers(DeepLinear(), ("linear",), first="yes")


def test_fit_alphas_and_the_error_for_a_layer_with_no_fit():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    with torch.no_grad():
        model[1].weight.zero_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the reason is data, not a warning
        fitted = tb.fit_alphas(matrix_layers(model), "median", filter_zeros=False)
    assert math.isfinite(fitted["0"].alpha) and not math.isfinite(fitted["1"].alpha)
    assert (fitted["0"].status, fitted["1"].status, fitted["1"].reason) == ("fitted", "failed", "all-zero weights")
    assert fitted["0"].num_evals == fitted["1"].num_evals == 64
    assert tb.finite_alphas({"0": fitted["0"]}) == {"0": fitted["0"].alpha}
    with pytest.raises(ValueError, match=r"TempBalanceCallback: no power-law fit for \['1'\] \(1: all-zero weights\)"):
        tb.finite_alphas(fitted)


# ---------------------------------------------------------------------------- constructor plumbing


def _plain_method():
    """A method declaring two settings, the way every callback of the package does."""
    from dataclasses import dataclass

    from lalr_lightning.callbacks.base import LayerwiseCallback

    @dataclass(eq=False, repr=False)
    class Plain(LayerwiseCallback):
        width: int = 4
        tags: tuple = ("a",)

    return Plain


def test_every_method_takes_checked_figures_and_the_deprecated_alias():
    import inspect

    made = _plain_method()
    params = inspect.signature(made).parameters
    assert list(params)[-2:] == ["figures", "plot_every_n_epochs"]
    assert params["figures"].kind is params["plot_every_n_epochs"].kind is inspect.Parameter.KEYWORD_ONLY
    assert made(width=2).figures == "never" and made(figures="3").figures == 3  # a command line's "3"
    with pytest.raises(ValueError, match="figures must be 'every'"):
        made(figures="sometimes")
    with pytest.raises(ValueError, match="width"):
        made(width="wide")  # checked against the annotation
    assert made(width="8").width == 8
    with pytest.warns(DeprecationWarning, match="plot_every_n_epochs= is deprecated"):
        assert made(plot_every_n_epochs=2).figures == 2
    with pytest.raises(ValueError, match="integer >= 1"):
        made(plot_every_n_epochs=0)


def test_settings_and_distinct_settings_read_the_fields_back():
    from lalr_lightning.callbacks.keys import distinct_settings
    from lalr_lightning.core.runtime.checks import distinct_settings as differing

    made = _plain_method()(width=8, tags=("a", "b"), name="x")
    # plain Python, name and strict_resume skipped, the shared figures last
    assert made.settings() == {"width": 8, "tags": ["a", "b"], "figures": "never"}
    assert distinct_settings(made) == {"width": 8, "tags": ["a", "b"]}
    assert distinct_settings(_plain_method()()) == {}
    assert differing(made.settings(), {"width": 4, "tags": ["a"]}, ("tags", "figures")) == {"width": 8}


def test_the_state_key_compares_with_the_settled_defaults_without_building_an_instance():
    """The key of an unnamed instance: its settings that differ from the class's defaults as the
    constructor settles them (None -> 0.5, a preset's metric), and no default instance is built."""
    from dataclasses import dataclass

    from lalr_lightning.callbacks import HTSRPruning, TempBalanceCallback
    from lalr_lightning.callbacks.base import LayerwiseCallback

    built = []

    @dataclass(eq=False, repr=False)
    class Counted(LayerwiseCallback):
        ratio: float | None = None

        def validate(self) -> None:
            super().validate()
            self.ratio = 0.5 if self.ratio is None else float(self.ratio)

        def __post_init__(self) -> None:
            super().__post_init__()
            built.append(self)

    assert Counted(ratio=0.5).state_key == "Counted" and Counted(ratio=2).state_key == "Counted{'ratio': 2.0}"
    assert len(built) == 2  # the two above: the defaults were settled on no instance
    assert TempBalanceCallback(lr_min_ratio=0.5, lr_max_ratio=1.5).state_key == "TempBalanceCallback"
    assert HTSRPruning(metric="alpha", min_evals=10, fit="ks").state_key == "HTSRPruning"  # the preset's own values
    assert HTSRPruning(min_evals=3).state_key == "HTSRPruning{'min_evals': 3}"


def test_a_method_decorated_as_a_plain_dataclass_is_refused():
    from dataclasses import dataclass

    from lalr_lightning.callbacks.base import LayerwiseCallback

    @dataclass
    class Compared(LayerwiseCallback):
        width: int = 4

    with pytest.raises(TypeError, match=r"@dataclass\(eq=False, repr=False\)"):
        Compared()


def test_substituted_parameters_follow_ties_only_where_an_override_names_a_tied_tensor():
    """call_with_params with the model's shared_names: an override of a tied tensor reaches every
    name that holds it (as functional_call's tie_weights=True does), any other override is
    substituted alone; fixed_rng draws as torch.manual_seed does and gives the stream back."""
    from torch.func import functional_call

    from lalr_lightning.core.model.taps import call_with_params, fixed_rng, shared_names

    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 4), nn.Linear(4, 5, bias=False))
    model[2].weight = model[0].weight  # a head tied to the input embedding
    shared = shared_names(model)
    assert shared == {"0.weight", "2.weight"}
    ids = torch.tensor([[1, 2, 3]])
    new_embed, new_mid = torch.randn(5, 4), torch.randn(4, 4)
    for override in ({"0.weight": new_embed}, {"1.weight": new_mid}):
        got = call_with_params(model, override, lambda: model(ids), shared)
        torch.testing.assert_close(got, functional_call(model, override, (ids,), tie_weights=True), rtol=0, atol=0)
    assert not torch.equal(call_with_params(model, {"0.weight": new_embed}, lambda: model(ids), shared),
                           functional_call(model, {"0.weight": new_embed}, (ids,), tie_weights=False))
    torch.manual_seed(3)
    before = torch.rand(4)
    torch.manual_seed(3)
    with fixed_rng(7):
        inside = torch.rand(4)
    torch.manual_seed(7)
    assert torch.equal(inside, torch.rand(4))  # the seed's draws
    torch.manual_seed(3)
    with fixed_rng(7):
        torch.rand(100)
    assert torch.equal(torch.rand(4), before)  # the stream goes on as if nothing had drawn
