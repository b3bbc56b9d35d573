"""Models: shapes, one training step, blocks and matrix layers, checkpoints, optimizers, errors."""

from __future__ import annotations

import functools
import logging

import pytest
import timm
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lalr_lightning.core.model.blocks import block_layers
from lalr_lightning.core.model.layers import matrix_layers
from lalr_lightning.models import (
    ClassifierModule,
    ImageClassifier,
    SmallCNN,
    SmallResNet,
    load_pretrained,
    read_state_dict,
)
from tests._toys import make_trainer


def _loader(n=8, c=1, hw=8, classes=10, batch_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, hw, hw, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)




def _assert_same(a: nn.Module, b: nn.Module, skip: str | None = None):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        if skip is not None and k.startswith(skip):
            continue
        assert torch.equal(sa[k], sb[k]), k


def _perturb(module: nn.Module, seed: int = 1):
    """Weights and BN statistics that no fresh model has, so a copy is told from a fresh init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in module.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)


# ---------------------------------------------------------------------------- shapes


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: SmallCNN(), (2, 1, 8, 8)),
        (lambda: SmallCNN(num_classes=7, in_channels=3, width=8), (2, 3, 32, 32)),
        (lambda: SmallResNet(), (2, 1, 8, 8)),
        (lambda: SmallResNet(num_classes=7, in_channels=3, width=8, blocks_per_group=1), (2, 3, 32, 32)),
        (lambda: ImageClassifier("resnet18", num_classes=7, in_chans=1, cifar_stem=True), (2, 1, 8, 8)),
    ],
)
def test_forward_shapes(make, shape):
    model = make()
    out = model(torch.randn(*shape))
    assert out.shape == (shape[0], model.num_classes)


def test_cifar_stem_replaces_conv1_and_maxpool():
    plain = ImageClassifier("resnet18", num_classes=10)
    assert plain.model.conv1.kernel_size == (7, 7) and plain.model.conv1.stride == (2, 2)
    m = ImageClassifier("resnet18", num_classes=10, cifar_stem=True)
    assert m.model.conv1.kernel_size == (3, 3) and m.model.conv1.stride == (1, 1)
    assert m.model.conv1.in_channels == 3 and m.model.conv1.out_channels == 64
    assert isinstance(m.model.maxpool, nn.Identity)
    # 32x32 stays 32x32 through the stem: 4x4 after the three stride-2 stages
    assert m.model.forward_features(torch.randn(1, 3, 32, 32)).shape[-2:] == (4, 4)


# ---------------------------------------------------------------------------- one training step


@pytest.mark.parametrize(
    "make, c, hw",
    [
        (lambda: SmallCNN(), 1, 8),
        (lambda: SmallResNet(), 1, 8),
        (lambda: ImageClassifier("resnet18", num_classes=10, in_chans=1, cifar_stem=True), 1, 8),
    ],
)
def test_one_training_step_logs_metrics(make, c, hw):
    model = make()
    trainer = make_trainer(fast_dev_run=True)
    trainer.fit(model, _loader(c=c, hw=hw), _loader(c=c, hw=hw, seed=1))
    for key in ("train/loss", "train/acc", "val/loss", "val/acc"):
        assert key in trainer.callback_metrics, key
    trainer.test(model, _loader(c=c, hw=hw, seed=2), verbose=False)
    assert {"test/loss", "test/acc"} <= set(trainer.callback_metrics)
    assert 0.0 <= float(trainer.callback_metrics["test/acc"]) <= 1.0
    logits = trainer.predict(model, _loader(c=c, hw=hw))
    assert logits[0].shape == (4, 10)


# ---------------------------------------------------------------------------- layers


def test_block_layers_of_the_models():
    assert [b.name for b in block_layers(SmallResNet())] == [
        "model.conv1+model.bn1+model.layer1", "model.layer2", "model.layer3", "model.fc"]
    assert [b.name for b in block_layers(SmallCNN())] == [
        "model.layer1", "model.layer2", "model.layer3", "model.layer4", "model.fc"]
    assert [b.name for b in block_layers(ImageClassifier("resnet18", num_classes=10))] == [
        "model.conv1+model.bn1+model.layer1", "model.layer2", "model.layer3", "model.layer4", "model.fc"]


@pytest.mark.parametrize("make", [SmallCNN, SmallResNet, lambda: ImageClassifier("resnet18", num_classes=10)])
def test_matrix_layers_tie_every_batchnorm(make):
    model = make()
    layers = matrix_layers(model)
    owned = {n for layer in layers for n in layer.params}
    bn_params = {f"{name}.{p}" for name, mod in model.named_modules() if isinstance(mod, nn.BatchNorm2d)
                 for p, _ in mod.named_parameters()}
    assert bn_params and bn_params <= owned  # every BN follows a conv
    assert set(dict(model.named_parameters())) == owned  # and nothing is left out
    by_name = {layer.name: layer for layer in layers}
    if isinstance(model, SmallCNN):
        assert "model.layer2.bn.weight" in by_name["model.layer2.conv"].params
    else:
        assert "model.layer1.0.bn2.weight" in by_name["model.layer1.0.conv2"].params
        assert "model.layer2.0.downsample.1.weight" in by_name["model.layer2.0.downsample.0"].params
    assert layers[-1].name == "model.fc"


def test_small_cnn_gives_tempbalance_enough_layers():
    layers = matrix_layers(SmallCNN())
    middle = layers[1:-1]  # TempBalance skips the first and last layer ...
    counts = [layer.weight.shape[2] * layer.weight.shape[3] * min(layer.weight.shape[:2]) for layer in middle]
    assert sum(c >= 50 for c in counts) >= 3  # ... and layers with fewer than 50 eigenvalues


# ---------------------------------------------------------------------------- checkpoints


@pytest.fixture
def resnet_ckpt(tmp_path):
    """A Lightning checkpoint of a SmallResNet after one step, with distinctive weights."""
    model = SmallResNet(width=8)
    trainer = make_trainer(fast_dev_run=True)
    trainer.fit(model, _loader())
    _perturb(model)
    path = tmp_path / "small.ckpt"
    trainer.save_checkpoint(path)
    return model, path


def test_lightning_checkpoint_restores_exactly(resnet_ckpt):
    src, path = resnet_ckpt
    _assert_same(SmallResNet(width=8, checkpoint=str(path)), src)
    # Lightning's own reload and resume read checkpoints with torch.load(weights_only=True):
    # the hyper-parameters must hold plain values only (no optimizer function)
    assert torch.load(path, weights_only=True)["hyper_parameters"]["width"] == 8
    _assert_same(SmallResNet.load_from_checkpoint(path), src)
    trainer = make_trainer(max_epochs=2, limit_train_batches=1, limit_val_batches=0)
    trainer.fit(SmallResNet(width=8), _loader(), ckpt_path=path)
    assert trainer.current_epoch == 2


def test_lightning_checkpoint_other_head_is_dropped(resnet_ckpt, caplog):
    src, path = resnet_ckpt
    fresh = SmallResNet(num_classes=5, width=8)
    with caplog.at_level(logging.WARNING, logger="lalr_lightning"):
        report = load_pretrained(fresh, path)
    assert report["dropped"] == ["fc.bias", "fc.weight"]
    assert "fc.weight (10, 32) -> (5, 32)" in caplog.text
    _assert_same(fresh.model, src.model, skip="fc.")
    assert fresh.model.fc.weight.shape == (5, 32)


def test_checkpoint_of_another_architecture_is_an_error(resnet_ckpt):
    _, path = resnet_ckpt
    with pytest.raises(ValueError, match="does not fit.*shape mismatch.*same architecture"):
        SmallResNet(width=16, checkpoint=str(path))


def test_image_classifier_from_lightning_checkpoint(tmp_path):
    # timm's tiny test_resnet keeps this fast; resnet18 goes through the same code
    src = ImageClassifier("test_resnet", num_classes=10, in_chans=1)
    trainer = make_trainer(fast_dev_run=True)
    trainer.fit(src, _loader(hw=16))
    _perturb(src)
    path = tmp_path / "r.ckpt"
    trainer.save_checkpoint(path)
    same = ImageClassifier("test_resnet", num_classes=10, in_chans=1, checkpoint=str(path))
    _assert_same(same, src)
    other = ImageClassifier("test_resnet", num_classes=3, in_chans=1, checkpoint=str(path))
    _assert_same(other.model, src.model, skip="fc.")
    assert other.model.fc.out_features == 3


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_image_classifier_from_timm_state_dict(tmp_path, suffix, caplog):
    net = timm.create_model("test_resnet", num_classes=10)
    _perturb(net)
    path = tmp_path / f"w{suffix}"
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(net.state_dict(), str(path))
    else:
        torch.save(net.state_dict(), path)
    _assert_same(ImageClassifier("test_resnet", num_classes=10, checkpoint=str(path)).model, net)
    with caplog.at_level(logging.WARNING, logger="lalr_lightning"):
        other = ImageClassifier("test_resnet", num_classes=4, checkpoint=str(path))
    assert "dropped the classifier fc" in caplog.text
    _assert_same(other.model, net, skip="fc.")
    assert other.model.fc.out_features == 4


def test_headless_backbone_file(tmp_path):
    net = timm.create_model("test_resnet", num_classes=10)
    _perturb(net)
    path = tmp_path / "backbone.pth"
    torch.save({k: v for k, v in net.state_dict().items() if not k.startswith("fc.")}, path)
    model = ImageClassifier("test_resnet", num_classes=5, checkpoint=str(path))
    _assert_same(model.model, net, skip="fc.")


def test_imagenet_stem_file_into_cifar_stem(tmp_path, caplog):
    net = timm.create_model("resnet18", num_classes=1000)
    _perturb(net)
    path = tmp_path / "in1k.pth"
    torch.save(net.state_dict(), path)
    with caplog.at_level(logging.WARNING, logger="lalr_lightning"):
        cifar = ImageClassifier("resnet18", num_classes=10, cifar_stem=True, checkpoint=str(path))
    # conv1 (7x7 -> 3x3) and the head start fresh, everything else is loaded
    assert "conv1.weight (64, 3, 7, 7) -> (64, 3, 3, 3)" in caplog.text and "fc.weight" in caplog.text
    assert cifar.model.conv1.kernel_size == (3, 3)
    _assert_same(nn.ModuleList([cifar.model.bn1, cifar.model.layer1, cifar.model.layer4]),
                 nn.ModuleList([net.bn1, net.layer1, net.layer4]))


def test_timm_file_adapts_input_channels(tmp_path):
    net = timm.create_model("test_resnet", num_classes=10)
    _perturb(net)
    path = tmp_path / "w.pth"
    torch.save({"state_dict": net.state_dict()}, path)
    gray = ImageClassifier("test_resnet", num_classes=10, in_chans=1, checkpoint=str(path))
    w = net.conv1[0].weight
    assert torch.allclose(gray.model.conv1[0].weight, w.sum(1, keepdim=True))


def test_read_state_dict_strips_lightning_prefix(resnet_ckpt):
    src, path = resnet_ckpt
    sd = read_state_dict(path)
    assert sd.keys() == src.model.state_dict().keys()


# ---------------------------------------------------------------------------- optimizers


def test_sgd_and_cosine_from_callables():
    model = SmallCNN(
        optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=5e-4),
        scheduler=functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=5),
    )
    cfg = model.configure_optimizers()
    assert isinstance(cfg["optimizer"], torch.optim.SGD)
    assert cfg["optimizer"].defaults["lr"] == 0.1 and cfg["optimizer"].defaults["momentum"] == 0.9
    sched = cfg["lr_scheduler"]
    assert isinstance(sched["scheduler"], torch.optim.lr_scheduler.CosineAnnealingLR)
    assert sched["scheduler"].T_max == 5 and sched["interval"] == "epoch" and "monitor" not in sched
    # callables are not plain values: kept out of hparams so checkpoints load with weights_only=True
    assert "optimizer" not in model.hparams and "scheduler" not in model.hparams


def test_default_optimizer_is_the_reference_sgd():
    opt = SmallCNN().configure_optimizers()
    assert isinstance(opt, torch.optim.SGD)
    assert (opt.defaults["lr"], opt.defaults["momentum"], opt.defaults["weight_decay"]) == (0.1, 0.9, 5e-4)


def test_plateau_gets_the_monitor_and_runs():
    model = SmallResNet(
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
        scheduler=lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0),
        scheduler_monitor="val/acc",
    )
    assert "optimizer" not in model.hparams and "scheduler" not in model.hparams
    cfg = model.configure_optimizers()
    assert isinstance(cfg["optimizer"], torch.optim.Adam)
    assert cfg["lr_scheduler"]["monitor"] == "val/acc"
    trainer = make_trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=1, num_sanity_val_steps=0)
    trainer.fit(model, _loader(), _loader(seed=1))  # Lightning finds the monitored metric


def test_cosine_shorter_than_the_run_warns():
    model = SmallCNN(width=8, scheduler=functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=5))
    trainer = make_trainer(max_epochs=2, limit_train_batches=1, limit_val_batches=0)
    with pytest.warns(UserWarning, match="T_max=5 but the run is 2 epochs"):
        trainer.fit(model, _loader())


def test_lightning_cli_yaml_builds_the_callables(monkeypatch):
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.setattr("sys.argv", ["lalr_lightning"])

    cfg = {
        "model": {
            "class_path": "lalr_lightning.models.SmallResNet",
            "init_args": {
                "num_classes": 5,
                "width": 8,
                "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.05, "momentum": 0.9}},
                "scheduler": {"class_path": "torch.optim.lr_scheduler.CosineAnnealingLR", "init_args": {"T_max": 3}},
            },
        },
        "trainer": {"max_epochs": 3, "logger": False},
    }
    cli = LightningCLI(ClassifierModule, subclass_mode_model=True, run=False, args=cfg, save_config_callback=None)
    model = cli.model
    assert isinstance(model, SmallResNet) and model.num_classes == 5
    cfg_opt = model.configure_optimizers()
    assert isinstance(cfg_opt["optimizer"], torch.optim.SGD) and cfg_opt["optimizer"].defaults["lr"] == 0.05
    assert cfg_opt["lr_scheduler"]["scheduler"].T_max == 3
    assert model.hparams["optimizer"]["class_path"] == "torch.optim.SGD"  # the config, for load_from_checkpoint


# ---------------------------------------------------------------------------- errors


def test_cifar_stem_without_conv1_is_a_clear_error():
    with pytest.raises(ValueError, match="cifar_stem=True needs a ResNet-style model.*conv1"):
        ImageClassifier("test_efficientnet", num_classes=10, cifar_stem=True)  # conv_stem
    with pytest.raises(ValueError, match="conv1 is a Sequential"):
        ImageClassifier("test_resnet", num_classes=10, cifar_stem=True)  # deep stem


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    missing = str(tmp_path / "nope.ckpt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ImageClassifier("resnet18", num_classes=10, checkpoint=missing)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SmallCNN(checkpoint=missing)


def test_unknown_model_and_bad_arguments():
    with pytest.raises(ValueError, match="unknown timm model"):
        ImageClassifier("resnet_does_not_exist", num_classes=10)
    with pytest.raises(ValueError, match="scheduler_interval"):
        SmallCNN(scheduler_interval="batch")


def test_pretrained_offline_names_the_checkpoint_option(monkeypatch):
    import timm.models._builder as builder

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(builder, "load_state_dict_from_hf", offline)
    monkeypatch.setattr(builder, "load_state_dict_from_url", offline)
    with pytest.raises(RuntimeError, match=r"pass checkpoint=<local file>"):
        ImageClassifier("resnet18", num_classes=10, pretrained=True)
