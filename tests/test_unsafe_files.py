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


def test_fsdp2_resume_reads_the_checkpoint_no_less_safely_than_lightning(tmp_path):
    """``OptimizerResume`` reads ``Trainer.fit(ckpt_path=...)``'s file before the strategy's own
    load under ModelParallelStrategy: the payload must not run there either."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import ModelParallelStrategy

    from lalr_lightning.callbacks.lightning_host import OptimizerResume

    marker = tmp_path / "payload_ran"
    path = tmp_path / "fsdp2.ckpt"
    torch.save({"optimizer_states": [{"state": {0: {"step": torch.tensor(1.0)}}}], "extra": _Payload(marker)}, path)
    model = SmallCNN(width=8)
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    strategy._lightning_module = model
    loaded = []
    type(strategy).load_checkpoint, real = (lambda self, p, weights_only=None: loaded.append(weights_only),
                                            ModelParallelStrategy.load_checkpoint)
    try:
        OptimizerResume.prepare(SimpleNamespace(strategy=strategy))
        with pytest.raises(UnsafeCheckpointError, match=r"weights_only=False to Trainer.fit"):
            strategy.load_checkpoint(str(path))  # Trainer.fit(ckpt_path=path): torch's default, weights_only
        assert not marker.exists() and loaded == []
        # Trainer.fit(ckpt_path=path, weights_only=False): the user's opt-in reaches both reads
        OptimizerResume.prepare(SimpleNamespace(strategy=strategy))
        strategy.load_checkpoint(str(path), weights_only=False)
        assert marker.exists() and loaded == [False]
    finally:
        ModelParallelStrategy.load_checkpoint = real


def _spawn_fit(callbacks: list) -> None:
    """One ddp_spawn step of a SmallCNN (here, not in the test: Lightning's hyper-parameter
    collection snapshots the calling frame's locals, which would keep the callbacks alive)."""
    from tests._dist import ddp_spawn
    from tests._toys import make_trainer

    x = torch.randn(32, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.arange(32) % 10), batch_size=8)
    make_trainer(callbacks, devices=2, strategy=ddp_spawn(), max_steps=1).fit(SmallCNN(width=8), loader)


def test_ddp_spawn_hand_back_is_read_safely_and_leaves_no_file(tmp_path, monkeypatch):
    import io
    import tempfile

    from lalr_lightning.callbacks import HTSRPruning, TempBalanceCallback, lightning_host

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # where a hand-back file would go
    reads = []
    load = torch.load

    def recording_load(f, *args, **kwargs):
        out = load(f, *args, **kwargs)
        if isinstance(f, io.BytesIO) and isinstance(out, dict) and read._handback_token in out:  # the handed-back state
            reads.append(kwargs.get("weights_only"))
        return out

    read, prune = TempBalanceCallback(), HTSRPruning(target_sparsity=0.5, epsilon=0, min_numel=1, min_evals=2)
    monkeypatch.setattr(lightning_host.torch, "load", recording_load)
    _spawn_fit([read, prune])
    assert read.multipliers and len(read.history) == 1  # handed back ...
    assert prune.masks and all(isinstance(m, torch.Tensor) for m in prune.masks.values())
    assert reads == [True]  # ... read once, with weights_only=True (numpy values arrive as numbers / tensors)
    assert list(tmp.glob("lalr_lightning_*.pt")) == []  # and no file is left in the temp directory


def test_cifar_batch_file_with_a_payload_is_refused_without_running_it(tmp_path):
    """``verify=False`` reads batch files whose md5 was not checked: they are unpickled with numpy
    arrays and lists allowed, nothing else."""
    import pickle

    import numpy as np

    from lalr_lightning.data import CIFARDataModule

    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    marker = tmp_path / "payload_ran"
    for i, f in enumerate([*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]):
        entry = {"data": np.full((20, 3072), i, dtype=np.uint8), "labels": [j % 10 for j in range(20)]}
        with open(folder / f, "wb") as fh:
            pickle.dump(entry, fh)
    dm = CIFARDataModule(data_dir=str(tmp_path), verify=False, val_n=20, train_n=60)
    dm.setup()  # plain batch files: read as before
    assert len(dm.train_set) == 60
    with open(folder / "data_batch_1", "wb") as fh:
        pickle.dump({"data": np.zeros((20, 3072), dtype=np.uint8), "labels": [0] * 20, "x": _Payload(marker)}, fh)
    with pytest.raises(RuntimeError, match=r"data_batch_1.*names posix.mkdir.*download=True"):
        CIFARDataModule(data_dir=str(tmp_path), verify=False, val_n=20, train_n=60).setup()
    assert not marker.exists()


def test_analyze_on_a_hf_directory_whose_bin_carries_a_payload_is_one_line(tmp_path, capsys):
    from lalr_lightning.cli import analyze_main
    from tests._lm import tiny_lm

    model = tiny_lm("llama", False)
    folder = tmp_path / "hf"
    model.config.save_pretrained(folder)
    marker = tmp_path / "payload_ran"
    torch.save({**model.state_dict(), "extra": _Payload(marker)}, folder / "pytorch_model.bin")
    assert analyze_main([str(folder), "--out", str(tmp_path / "report"), "--no-plots"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert str(folder / "pytorch_model.bin") in err and "mkdir" in err and "safetensors" in err
    assert not marker.exists() and not (tmp_path / "report").exists()
