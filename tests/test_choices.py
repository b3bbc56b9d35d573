"""A mistyped value gets the nearest valid one, as a mistyped key does (lalr_lightning.choices)."""

from __future__ import annotations

import pytest

from lalr_lightning.choices import closest, suggestion, unknown


def test_the_nearest_choice_or_none():
    assert closest("linearmap", ["linear_map", "identity", "square"]) == "linear_map"
    assert closest("Median", ["median", "ks", "peak"]) == "median"  # case is not a typo worth refusing silently
    assert closest("zzz", ["median", "ks", "peak"]) is None
    assert suggestion("zzz", ["median", "ks"]) == ""
    assert suggestion(3, ("matrix", "block")) == ""  # a non-string value: no crash, no hint


def test_the_message_lists_the_choices_then_the_suggestion():
    err = unknown("assign", "linearmap", ["linear_map", "identity"])
    assert str(err) == "unknown assign 'linearmap'; valid: linear_map, identity; did you mean 'linear_map'?"
    err = unknown("granularity", "blok", ("matrix", "block"), show=repr, note=" (or a callable)")
    assert str(err) == "unknown granularity 'blok'; valid: 'matrix', 'block' (or a callable); did you mean 'block'?"
    assert str(unknown("fit", "xyz", ["median", "ks"])) == "unknown fit 'xyz'; valid: median, ks"


@pytest.mark.smoke
@pytest.mark.parametrize(("make", "near"), [
    (lambda: __import__("lalr_lightning.callbacks", fromlist=["x"]).TempBalanceCallback(assign="linearmap"),
     "linear_map"),
    (lambda: __import__("lalr_lightning.callbacks", fromlist=["x"]).TempBalanceCallback(fit="medain"), "median"),
    (lambda: __import__("lalr_lightning.callbacks", fromlist=["x"]).BlockSchedule(schedule="lisaa"), "lisa"),
    (lambda: __import__("lalr_lightning.callbacks", fromlist=["x"]).ProximalRegularizer(lam=1.0, granularity="tensr"),
     "tensor"),
    (lambda: __import__("lalr_lightning.callbacks", fromlist=["x"]).SpectrumSelect(grouping="spectrun"), "spectrum"),
    (lambda: __import__("lalr_lightning.callbacks", fromlist=["x"]).HTSRPruning(criterion="wandaa"), "wanda"),
    (lambda: __import__("lalr_lightning.data.text", fromlist=["x"]).TextDataModule(dataset="sst"), "sst2"),
])
def test_callbacks_and_core_suggest_the_nearest_value(make, near):
    with pytest.raises(ValueError) as err:
        make()
    msg = str(err.value)
    assert "\n" not in msg and "; valid: " in msg, msg
    assert msg.endswith(f"; did you mean {near!r}?"), msg


def test_a_mistyped_value_in_a_config_gets_the_suggestion_on_the_one_error_line(tmp_path, monkeypatch, capsys):
    from lalr_lightning.cli import main
    from tests.test_cli import _quickstart_with

    config = _quickstart_with(tmp_path, lambda cfg: cfg["trainer"]["callbacks"][0]["init_args"].update(
        assign="linearmap"))
    monkeypatch.setattr("sys.argv", ["/usr/local/bin/lalr-lightning", "fit", "--config", str(config)])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lalr-lightning: error: "), err[-5:]
    assert "unknown assign 'linearmap'" in err[0] and err[0].endswith("did you mean 'linear_map'?"), err[0]
