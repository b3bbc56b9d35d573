"""No file runs code unless the user opts in (issue 42, rows 1, 2 and 7): a torch file whose
pickle calls a function is refused in one line naming the opt-in, and the opt-in still reads it.

The payload is real: unpickling it calls ``os.mkdir(marker)``, so the marker directory is the
proof that code from the file ran."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml

from lalr_lightning.models import SmallCNN, read_state_dict
from lalr_lightning.models.base import UnsafeCheckpointError

ROOT = Path(__file__).resolve().parents[1]


class _Payload:
    """Unpickling it creates the directory ``marker``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.fixture()
def payload_ckpt(tmp_path) -> tuple[Path, Path, SmallCNN]:
    """A Lightning-style checkpoint of the quickstart's SmallCNN that also carries a payload."""
    torch.manual_seed(0)
    src = SmallCNN(width=32, in_channels=1)
    marker = tmp_path / "payload_ran"
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in src.model.state_dict().items()},
                "pytorch-lightning_version": "2.5.0", "extra": _Payload(marker)}, path)
    return path, marker, src


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_read_state_dict_refuses_a_payload_and_reads_it_when_opted_in(payload_ckpt):
    path, marker, src = payload_ckpt
    with pytest.raises(UnsafeCheckpointError) as info:
        read_state_dict(path)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg and "weights_only=False" in msg and "mkdir" in msg
    assert not marker.exists()  # nothing ran
    sd = read_state_dict(path, weights_only=False)  # opted in: read (and the payload runs, as asked)
    assert marker.exists()
    assert sd.keys() == src.model.state_dict().keys()


def test_model_checkpoint_refuses_a_payload_unless_unsafe_load(payload_ckpt):
    path, marker, src = payload_ckpt
    with pytest.raises(UnsafeCheckpointError, match=r"unsafe_load=True to SmallCNN.*--model.init_args.unsafe_load"):
        SmallCNN(width=32, in_channels=1, checkpoint=str(path))
    assert not marker.exists()
    model = SmallCNN(width=32, in_channels=1, checkpoint=str(path), unsafe_load=True)
    assert marker.exists() and _same_weights(model.model, src.model)
    # the opt-in is not stored: a checkpoint of this module does not carry it to the next reader
    assert "unsafe_load" not in model.hparams and model.hparams["checkpoint"] == str(path)


def test_fit_with_a_config_checkpoint_payload_is_one_line_naming_the_flag(payload_ckpt, tmp_path, capsys):
    from lalr_lightning.cli import main

    path, marker, src = payload_ckpt
    cfg = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())
    cfg["model"]["init_args"]["checkpoint"] = str(path)  # a config whose `checkpoint:` names the file
    cfg["trainer"].update(logger=False, max_epochs=1, limit_train_batches=1, limit_val_batches=0,
                          default_root_dir=str(tmp_path))
    cfg["trainer"]["callbacks"] = cfg["trainer"]["callbacks"][:1]
    config = tmp_path / "evil.yaml"
    config.write_text(yaml.safe_dump(cfg))
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(config)])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "not recommended" not in line]
    assert info.value.code == 2 and len(err) == 1, err
    assert str(path) in err[0] and "--model.init_args.unsafe_load true" in err[0]
    assert not marker.exists()
    # opted in on the command line: the fit runs from the file's weights
    main(["fit", "--config", str(config), "--model.init_args.unsafe_load", "true"])
    assert marker.exists()
