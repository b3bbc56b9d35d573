"""Memory and speed of the selection methods against full fine-tuning and LoRA, on one process and on 2 DDP ranks.

A LLaMA-shaped causal LM is built offline from a ``LlamaConfig`` (random init, float32; default
``--model 0.2b``: hidden 1024, 12 layers, MLP 2816, 16 heads, vocabulary 32000, untied head,
0.22 B parameters; ``--model 0.54b`` is the model of ``benchmarks/llm_analysis.py``) inside
:class:`lalr_lightning.models.CausalLMModule` and trained by a Lightning ``Trainer`` with AdamW
(lr ``--lr``, no weight decay) for ``--steps`` optimizer steps, each rank on one fixed batch of
``--batch`` random token sequences of ``--seq`` tokens (the same batch every step, so the loss
shows how far each arm fits it in the same number of steps). Arms:

* ``full``: every parameter trains;
* ``lora8``, ``lora16``: peft LoRA r=8 / r=16 on the q/v projections (peft's LLaMA default);
* ``spectrum25``, ``spectrum50``: ``SpectrumSelect(top_percent=25 / 50)`` (embeddings and head
  always train, as in Spectrum's YAML);
* ``lisa``, ``lisa_keep``: ``BlockSchedule("lisa", gamma=2, every_n_steps=--lisa-every)`` with
  ``optimizer_state="release"`` (state of blocks that stop training freed) and ``"keep"``
  (LMFlow's callback: the state of every block ever drawn is kept);
* ``surgical``: ``SurgicalBlocks(select=[0 .. k-1])``, the first ``k`` blocks (``--surgical-k``,
  default a quarter of the layers; the embedding is joined to the first block);
* ``lmsa``: ``LMSAStepper()`` with the paper's settings (one block picked by ``J_hat``, moved by
  maximizing its Hamiltonian with its own Adam, lr 1e-4, 5 iterations per step).

Every arm runs in its own child process (``ddp_spawn``: the main process and 2 spawned ranks),
so each peak RSS is that arm's alone. A callback on every rank counts bytes from the tensors:

* ``grads``: ``p.grad`` of every parameter at ``on_before_optimizer_step`` (after the backward,
  before frozen gradients are dropped: what was computed and, under DDP, all-reduced), or, if
  larger, the gradients L-MSA forms outside the backward in the step: a block's direction ``r_n``
  on a measurement batch (one block at a time) and the Hamiltonian's gradient that its inner Adam
  steps on;
* ``state``: every tensor in the optimizers' ``state`` after the step (L-MSA's inner Adam included);
* ``trained``: the parameters updated in the step (those with a gradient the optimizer used, or
  whose values changed: L-MSA moves its block outside the optimizer); ``need`` = 12 bytes per
  trained parameter (fp32 gradient + AdamW's two moments), and ``(grads + state) / need`` is the
  largest over the steps (AdamW's per-tensor step counters are in ``state``);
* ``DDP buckets``: the bytes of the gradient buckets DDP allocates for the parameters that
  required a gradient when it wrapped the model (torch's own ``_get_ddp_logging_data``);
* peak RSS (``VmHWM`` of each process) and, on a GPU, ``torch.cuda.max_memory_allocated``;
* tokens per second: global tokens per step over the median step time (first step left out),
  timed from ``on_train_batch_start`` to ``on_train_batch_end``;
* the training loss at the last step (mean over ranks).

    python benchmarks/memory.py                        # 0.2 B, all arms, single and 2 ranks
    python benchmarks/memory.py --model 0.54b --modes single
    python benchmarks/memory.py --quick                # tiny model, 2 steps, single process (seconds)

Under ``ddp_spawn`` each rank gets ``cores // ranks`` threads; the single process gets all cores.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

MODELS = {  # LlamaConfig arguments
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, vocab_size=256),
    "30m": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8, vocab_size=8000),
    "0.2b": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                 vocab_size=32000),
    "0.54b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                  vocab_size=32000),
}
ARMS = ("full", "lora8", "lora16", "spectrum25", "spectrum50", "lisa", "lisa_keep", "surgical", "lmsa")
SELECTION_ARMS = ("spectrum25", "spectrum50", "lisa", "surgical", "lmsa")  # the 10% bar
NEED_BYTES = 12  # per trained parameter: fp32 gradient + AdamW's exp_avg and exp_avg_sq


def hwm_kb(key: str = "VmHWM") -> int:
    """This process's peak (``VmHWM``) or current (``VmRSS``) resident memory in KiB (Linux);
    ``ru_maxrss`` otherwise (which a spawned or forked child may inherit from its parent)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# the largest gradient L-MSA holds outside the backward during the current batch, in bytes
_TRANSIENT = [0]


def _note_transient(tensors) -> None:
    _TRANSIENT[0] = max(_TRANSIENT[0], sum(_nbytes(t) for t in tensors if t is not None))


class MeteredAdam(torch.optim.Adam):
    """L-MSA's inner Adam (lr 1e-4, the paper's), noting the gradient it steps on."""

    def __init__(self, params):
        super().__init__(params, lr=1e-4)

    def step(self, closure=None):
        _note_transient(p.grad for g in self.param_groups for p in g["params"])
        return super().step(closure)


def _meter_lmsa_directions() -> None:
    """Note each block direction ``r_n`` the L-MSA metric forms (in this process: every rank)."""
    from lalr_lightning.core.selection import msa

    if getattr(msa.block_direction, "metered", False):
        return
    inner = msa.block_direction

    def block_direction(*a, **k):
        r = inner(*a, **k)
        _note_transient(r)
        return r

    block_direction.metered = True
    msa.block_direction = block_direction


# --------------------------------------------------------------------------- the arm, in a child


class Batches(torch.utils.data.Dataset):
    """``steps * world`` items cycling through ``world`` fixed batches: with Lightning's
    ``DistributedSampler`` (no shuffle) rank ``r`` gets batch ``r`` at every step."""

    def __init__(self, vocab: int, batch: int, seq: int, steps: int, world: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.batches = [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(world)]
        self.n = steps * world

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = self.batches[i % len(self.batches)]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


class Meter(Callback):
    """Counts parameter, gradient and optimizer-state bytes, trained parameters, step times and
    the loss on its rank; writes them as JSON to ``out`` (``{rank}`` filled in) at fit end."""

    def __init__(self, out: str, threads: int | None = None, lmsa: bool = False):
        self.out, self.threads, self.lmsa = out, threads, lmsa

    def setup(self, trainer, pl_module, stage):
        if self.threads:
            torch.set_num_threads(self.threads)
        if self.lmsa:
            _meter_lmsa_directions()
        self._t_setup = time.perf_counter()

    def on_train_start(self, trainer, pl_module):
        # setup to the first batch: the static selections' decisions (Spectrum's SNR), the wrap, the optimizer
        self.setup_s = time.perf_counter() - self._t_setup

    def _params(self, pl_module):
        return [p for _, p in pl_module.named_parameters()]

    def on_fit_start(self, trainer, pl_module):
        self.steps: list[dict] = []
        params = self._params(pl_module)
        self.param_bytes = sum(_nbytes(p) for p in params)
        self.n_params = sum(p.numel() for p in params)
        wrapped = trainer.strategy.model
        # requires_grad when the strategy wrapped the model: DDP registered (and buckets) exactly these
        self.registered = sum(p.numel() for p in params if p.requires_grad)
        self.ddp = None
        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            self.ddp = wrapped
        if torch.cuda.is_available() and trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
        self.rss_fit_start = hwm_kb("VmRSS")  # model built (and, under ddp_spawn, unpickled), nothing trained

    def _state_bytes(self, trainer) -> int:
        opts = list(trainer.optimizers)
        for cb in trainer.callbacks:  # L-MSA's inner optimizer holds the state of the block it moves
            inner = getattr(cb, "_inner", None)
            if isinstance(inner, torch.optim.Optimizer):
                opts.append(inner)
        return sum(_nbytes(v) for opt in opts for st in opt.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        with torch.no_grad():
            # in the parameters' dtype: a float64 sum would copy every tensor and raise the RSS by GiBs
            self._sums = [p.detach().sum() for p in self._params(pl_module)]
        self._cur = {}
        _TRANSIENT[0] = 0
        self._t0 = time.perf_counter()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        params = self._params(pl_module)
        self._cur["grads"] = sum(_nbytes(p.grad) for p in params if p.grad is not None)
        self._cur["with_grad"] = sum(p.numel() for p in params if p.grad is not None)
        self._cur["state_before"] = self._state_bytes(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        dt = time.perf_counter() - self._t0
        params = self._params(pl_module)
        in_opt = {id(p) for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]}
        with torch.no_grad():
            changed = [bool(s != p.detach().sum()) for s, p in zip(self._sums, params)]
        trained = sum(p.numel() for p, c in zip(params, changed)
                      if c or (id(p) in in_opt and p.grad is not None))
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self._cur["transient"] = _TRANSIENT[0]
        self._cur["grads"] = max(self._cur["grads"], _TRANSIENT[0])
        self._cur.update(
            time=dt, trained=trained, state=self._state_bytes(trainer),
            grads_after=sum(_nbytes(p.grad) for p in params if p.grad is not None),
            loss=float(loss.detach()) if loss is not None else float("nan"),
        )
        self.steps.append(self._cur)

    def on_fit_end(self, trainer, pl_module):
        buckets = None
        if self.ddp is not None:
            try:
                data = self.ddp._get_ddp_logging_data()
                sizes = data.get("bucket_sizes")
                buckets = sum(int(s) for s in str(sizes).split(",") if s.strip()) if sizes else None
            except Exception:  # private API: leave the column empty rather than fail the run
                buckets = None
        cuda = None
        if torch.cuda.is_available() and trainer.strategy.root_device.type == "cuda":
            cuda = torch.cuda.max_memory_allocated(trainer.strategy.root_device)
        res = dict(rank=trainer.global_rank, world=trainer.world_size, threads=torch.get_num_threads(),
                   params=self.n_params, param_bytes=self.param_bytes, registered=self.registered,
                   ddp_bucket_bytes=buckets, cuda_max_allocated=cuda, steps=self.steps,
                   rss_fit_start_kb=self.rss_fit_start, peak_rss_kb=hwm_kb(), setup_s=self.setup_s)
        with open(self.out.format(rank=trainer.global_rank), "w") as f:
            json.dump(res, f)


def build_module(args, arm: str):
    from lalr_lightning.models import CausalLMModule

    lora = arm.startswith("lora")
    cfg = dict(model_type="llama", tie_word_embeddings=False, max_position_embeddings=max(args.seq, 64),
               **MODELS[args.model])
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    torch.manual_seed(args.seed)
    return CausalLMModule(config=cfg, lora=lora, lora_r=int(arm[4:]) if lora else 8, lora_alpha=16,
                          lora_dropout=0.0, model_kwargs={"attn_implementation": args.attn},
                          optimizer=functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=0.0))


def build_callbacks(args, arm: str) -> list[Callback]:
    from lalr_lightning.callbacks import BlockSchedule, LMSAStepper, SpectrumSelect, SurgicalBlocks

    layers = MODELS[args.model]["num_hidden_layers"]
    if arm.startswith("spectrum"):
        return [SpectrumSelect(top_percent=float(arm[len("spectrum"):]))]
    if arm in ("lisa", "lisa_keep"):
        return [BlockSchedule("lisa", gamma=args.gamma, every_n_steps=args.lisa_every,
                              optimizer_state="keep" if arm == "lisa_keep" else "release")]
    if arm == "surgical":
        k = args.surgical_k or max(1, layers // 4)
        return [SurgicalBlocks(select=list(range(k)))]
    if arm == "lmsa":
        return [LMSAStepper(inner_optimizer=MeteredAdam)]
    return []


def hf_meter(out: str):
    """:class:`Meter`'s counts on Hugging Face's ``Trainer`` (a ``TrainerCallback``): gradients at
    ``on_pre_optimizer_step`` (after the backward and the clip), optimizer state after the step."""
    from transformers import TrainerCallback

    class HFMeter(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            self.model, self.opt = model, getattr(optimizer, "optimizer", optimizer)
            params = list(model.parameters())
            self.steps, self.setup_s = [], time.perf_counter() - self.t_init
            self.param_bytes, self.n_params = sum(_nbytes(p) for p in params), sum(p.numel() for p in params)
            self.registered = sum(p.numel() for p in params if p.requires_grad)
            self.rss_fit_start = hwm_kb("VmRSS")

        def _state(self) -> int:
            return sum(_nbytes(v) for st in self.opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))

        def on_step_begin(self, args, state, control, **kwargs):
            with torch.no_grad():
                self._sums = [p.detach().sum() for p in self.model.parameters()]
            self._cur, self._t0 = {}, time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            params = list(self.model.parameters())
            self._cur["grads"] = sum(_nbytes(p.grad) for p in params if p.grad is not None)
            self._cur["with_grad"] = sum(p.numel() for p in params if p.grad is not None)
            self._with = {id(p) for p in params if p.grad is not None}

        def on_step_end(self, args, state, control, **kwargs):
            params = list(self.model.parameters())
            with torch.no_grad():
                changed = [bool(s != p.detach().sum()) for s, p in zip(self._sums, params)]
            trained = sum(p.numel() for p, c in zip(params, changed) if c or id(p) in self._with)
            self._cur.update(time=time.perf_counter() - self._t0, trained=trained, state=self._state(),
                             transient=0, loss=float("nan"))
            self.steps.append(self._cur)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs and self.steps:
                self.steps[-1]["loss"] = float(logs["loss"])

        def on_train_end(self, args, state, control, **kwargs):
            res = dict(rank=0, world=1, threads=torch.get_num_threads(), params=self.n_params,
                       param_bytes=self.param_bytes, registered=self.registered, ddp_bucket_bytes=None,
                       cuda_max_allocated=None, steps=self.steps, rss_fit_start_kb=self.rss_fit_start,
                       peak_rss_kb=hwm_kb(), setup_s=self.setup_s)
            with open(out.format(rank=0), "w") as f:
                json.dump(res, f)

    meter = HFMeter()
    meter.t_init = time.perf_counter()
    return meter


def run_arm_hf(args, arm: str, out_dir: str) -> dict:
    """One arm on Hugging Face's ``Trainer`` (one process): the same model, batch, AdamW and
    callbacks (``lalr_lightning.hf.trainer_callback``); LoRA through peft's ``get_peft_model``."""
    from transformers import Trainer, TrainingArguments

    from lalr_lightning.hf import trainer_callback

    model = build_module(args, "full").model  # the same LlamaForCausalLM, seed and attention
    if arm.startswith("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=int(arm[4:]), lora_alpha=16, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    out = os.path.join(out_dir, f"{arm}-hf-{{rank}}.json")
    meter = hf_meter(out)
    data = Batches(MODELS[args.model]["vocab_size"], args.batch, args.seq, args.steps, 1, args.seed)
    rows = [{**data[i], "labels": data[i]["input_ids"]} for i in range(len(data))]
    targs = TrainingArguments(output_dir=os.path.join(out_dir, "hf"), max_steps=args.steps, learning_rate=args.lr,
                              weight_decay=0.0, lr_scheduler_type="constant", per_device_train_batch_size=1,
                              report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
                              use_cpu=args.accelerator == "cpu", max_grad_norm=0.0)
    # each row already is a batch: the collator unwraps the Trainer's batch of one
    trainer = Trainer(model=model, args=targs, train_dataset=rows, data_collator=lambda items: items[0],
                      callbacks=[meter, *trainer_callback(build_callbacks(args, arm))])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return summarize(args, arm, "hf", [json.load(open(out.format(rank=0)))], main_kb=hwm_kb())


ENGINE_ARMS = ("full", "lora8", "spectrum25", "lisa", "surgical")


def _local_bytes(t: torch.Tensor) -> int:
    """The bytes this rank holds of ``t`` (a DTensor: its local shard)."""
    return _nbytes(t.to_local() if hasattr(t, "to_local") else t)


def _engine_arm(args, engine: str, arm: str) -> dict:
    """One arm under one engine (:func:`engine_child`)."""
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from lalr_lightning.hf import trainer_callback

    fsdp2 = engine == "fsdp2"
    if fsdp2:
        from tests._hf_fsdp2 import cpu_fsdp2

        cpu_fsdp2()
        where = {"fsdp": True, "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
    else:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        from tests._hf_engines import ds_config

        AcceleratorState._reset_state()
        unset_hf_deepspeed_config()
        where = {"deepspeed": ds_config(int(engine[-1]))}
    model = build_module(args, "full").model
    if arm.startswith("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=int(arm[4:]), lora_alpha=16, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    cbs = build_callbacks(args, arm)
    seen: dict = {"grads": 0, "switch_s": []}
    for cb in cbs:  # the time of each decision's apply: freezing, state released
        inner = cb.apply

        def timed(host, inner=inner):
            t = time.perf_counter()
            inner(host)
            seen["switch_s"].append(time.perf_counter() - t)

        cb.apply = timed

    def torch_optimizer():  # the one that steps: ZeRO's inside its engine, else accelerate's wrapped one
        return trainer.optimizer.optimizer if fsdp2 else trainer.model_wrapped.optimizer.optimizer

    class Count(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            seen["build_s"] = time.perf_counter() - seen["t0"]

            def grads(opt, *_):  # ZeRO steps its torch optimizer once per group: summed per step
                seen["cur"] += sum(_local_bytes(p.grad) for g in opt.param_groups for p in g["params"]
                                   if p.grad is not None)

            torch_optimizer().register_step_pre_hook(grads)

        def on_step_begin(self, a, state, control, **kw):
            seen["cur"] = 0

        def on_step_end(self, a, state, control, **kw):
            seen["grads"] = max(seen["grads"], seen["cur"])

    data = Batches(MODELS[args.model]["vocab_size"], args.batch, args.seq, args.steps, 1, args.seed)
    rows = [{**data[i], "labels": data[i]["input_ids"]} for i in range(len(data))]
    targs = TrainingArguments(output_dir=os.path.join(tempfile.gettempdir(), "lalr_engines"),
                              max_steps=args.steps, learning_rate=args.lr, weight_decay=0.0,
                              lr_scheduler_type="constant", per_device_train_batch_size=1, report_to="none",
                              save_strategy="no", disable_tqdm=True, use_cpu=True,
                              accelerator_config={"use_configured_state": True}, **where)
    trainer = Trainer(model=model, args=targs, train_dataset=rows, data_collator=lambda items: items[0],
                      callbacks=[*trainer_callback(cbs), Count()])
    seen["t0"] = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    opt = torch_optimizer()
    state = sum(_local_bytes(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    if fsdp2:  # every parameter's shard, frozen or not (FSDP2 shards them all)
        fp32 = sum(_local_bytes(p) for p in trainer.model.parameters())
    else:  # the engine's fp32 partitions (what trains)
        zero = trainer.model_wrapped.optimizer
        flats = list(getattr(zero, "fp32_partitioned_groups_flat", None) or zero.single_partition_of_fp32_groups)
        fp32 = sum(_nbytes(f) for f in flats)
    return dict(engine=engine, arm=arm, fp32=fp32, state=state, grads=seen["grads"],
                params=sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters()),
                build_s=seen.get("build_s"), switch_s=seen["switch_s"][1:])  # after the first


def engine_child(args) -> None:
    """One rank of ``--engines``: every arm in turn on the Hugging Face Trainer under each engine
    (DeepSpeed ZeRO-2 / ZeRO-3 on CPU: tests/_hf_engines.py's workarounds; FSDP2: tests/_hf_fsdp2.py's),
    counting from the engine's own tensors per rank: the fp32 partitions (FSDP2: the parameters'
    shards), the optimizer state after the last step, the largest gradient (partition or shard) the
    optimizer got, and the time of each LISA switch."""
    sys.path.insert(0, str(ROOT))
    if any(e.startswith("zero") for e in args.engines):
        from tests._hf_engines import cpu_deepspeed

        cpu_deepspeed()
    results = [_engine_arm(args, engine, arm) for engine in args.engines for arm in args.arms]
    rank = int(os.environ.get("RANK", 0))
    with open(os.path.join(args.engine_out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def engines_main(args, argv: list[str]) -> list[dict]:
    """``--engines``: the arms on 2 ranks under each engine, DeepSpeed's in one ``torch.distributed.run``,
    FSDP2 in another (importing DeepSpeed's helper makes accelerate pick DeepSpeed)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2)), "DS_ACCELERATOR": "cpu"}
    launches = [[e for e in args.engines if e.startswith("zero")], [e for e in args.engines if e == "fsdp2"]]
    drop = _drop_option(argv, "--engines")
    ranks: list[list[dict]] = [[], []]
    for engines in [e for e in launches if e]:
        out = tempfile.mkdtemp()
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(Path(__file__)),
                        *drop, "--engines", *engines, "--engine-out", out], env=env, check=True)
        for r in (0, 1):
            ranks[r] += json.loads(Path(out, f"rank{r}.json").read_text())
    lines = ["| engine | arm | fp32 partitions (FSDP2: parameter shards) / rank | optimizer state / rank | "
             "gradients / rank | engine build s | LISA switch s |", "|---|---|---|---|---|---|---|"]
    for a, b in zip(*ranks):
        switch = f"{statistics.median(a['switch_s']):.4f}" if a["switch_s"] else "-"
        lines.append(f"| {a['engine']} | {a['arm']} | {_mb(a['fp32'])} / {_mb(b['fp32'])} | "
                     f"{_mb(a['state'])} / {_mb(b['state'])} | {_mb(a['grads'])} / {_mb(b['grads'])} | "
                     f"{a['build_s']:.2f} | {switch} |")
    print("\n".join(lines))
    return ranks[0]


def _drop_option(argv: list[str], name: str) -> list[str]:
    """``argv`` without the option ``name`` and its values (up to the next option)."""
    out, skipping = [], False
    for a in argv:
        if a == name:
            skipping = True
        elif skipping and a.startswith("--"):
            skipping = False
            out.append(a)
        elif not skipping:
            out.append(a)
    return out


def run_arm(args, arm: str, mode: str, out_dir: str) -> dict:
    """Train one arm (in this process; ``ddp``: spawning the ranks; ``hf``: on Hugging Face's
    Trainer) and return its figures."""
    if mode == "hf":
        return run_arm_hf(args, arm, out_dir)
    for name in ("lightning.pytorch", "lightning.fabric", "lalr_lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    world = 2 if mode == "ddp" else 1
    cores = os.cpu_count() or 1
    module = build_module(args, arm)
    out = os.path.join(out_dir, f"{arm}-{mode}-{{rank}}.json")
    meter = Meter(out, threads=max(1, cores // world) if world > 1 else None, lmsa=arm == "lmsa")
    data = torch.utils.data.DataLoader(
        Batches(MODELS[args.model]["vocab_size"], args.batch, args.seq, args.steps, world, args.seed),
        batch_size=None)
    kw = dict(strategy="ddp_spawn", devices=world) if world > 1 else dict(devices=1)
    trainer = pl.Trainer(accelerator=args.accelerator, max_steps=args.steps, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, callbacks=[meter, *build_callbacks(args, arm)],
                         **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, train_dataloaders=data)
    ranks = [json.load(open(out.format(rank=r))) for r in range(world)]
    return summarize(args, arm, mode, ranks, main_kb=hwm_kb())


def summarize(args, arm: str, mode: str, ranks: list[dict], main_kb: int) -> dict:
    r0 = ranks[0]
    world = len(ranks)
    steps = [s for r in ranks for s in r["steps"]]
    times = [s["time"] for s in r0["steps"]]
    timed = times[1:] if len(times) > 1 else times
    tokens = args.batch * args.seq * world

    def peak(key):
        return max(s[key] for s in steps)

    ratios = [(s["grads"] + s["state"]) / (NEED_BYTES * s["trained"]) for s in steps if s["trained"]]
    last = [r["steps"][-1]["loss"] for r in ranks]
    return dict(
        arm=arm, mode=mode, world=world, threads=r0["threads"], params=r0["params"], param_bytes=r0["param_bytes"],
        registered=r0["registered"], trained=peak("trained"), need=NEED_BYTES * peak("trained"),
        grads=peak("grads"), state=peak("state"), with_grad=peak("with_grad"),
        ratio=max(ratios) if ratios else float("nan"), ddp_bucket_bytes=r0["ddp_bucket_bytes"],
        cuda_max_allocated=[r["cuda_max_allocated"] for r in ranks] if r0["cuda_max_allocated"] else None,
        main_rss_kb=main_kb, rank_rss_kb=[r["peak_rss_kb"] for r in ranks],
        fit_start_rss_kb=[r["rss_fit_start_kb"] for r in ranks],
        step_s=statistics.median(timed), tokens_per_s=tokens / statistics.median(timed),
        loss=sum(last) / len(last), setup_s=r0["setup_s"],
        per_step=[dict(trained=s["trained"], grads=s["grads"], state=s["state"], transient=s.get("transient", 0))
                  for s in r0["steps"]],
    )


def child(args) -> None:
    with tempfile.TemporaryDirectory(prefix="memory_bench_") as d:
        res = run_arm(args, args.child, args.child_mode, d)
    print("RESULT " + json.dumps(res))


# --------------------------------------------------------------------------- the parent


def run_in_child(argv: list[str], arm: str, mode: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")  # this checkout's lalr_lightning
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", arm, "--child-mode", mode]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        return dict(arm=arm, mode=mode, error=(out.stderr.strip().splitlines() or ["?"])[-1][:300])
    return json.loads(lines[-1][len("RESULT "):])


def _mb(b) -> str:
    return "-" if b is None else f"{b / 1e6:,.0f}" if b >= 1e7 else f"{b / 1e6:,.2f}"


def _m(n) -> str:
    return f"{n / 1e6:.2f} M" if n >= 1e5 else f"{n:,}"


def _gib(kb) -> str:
    return f"{kb / 2**20:.2f}"


def _mode(r: dict) -> str:
    return "HF Trainer" if r["mode"] == "hf" else "1 process" if r["world"] == 1 else f"{r['world']} ranks"


def table(results: list[dict]) -> list[str]:
    head = ("| arm | mode | trained params | need (12 B each), MB | grads, MB | AdamW state, MB | (grads + state) / need "
            "| params, MB | DDP buckets, MB | peak RSS, GiB (main; ranks) | RSS at fit start, GiB | tokens/s | vs full | loss |")
    rows = [head, "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|"]
    full = {r["mode"]: r for r in results if r["arm"] == "full" and "error" not in r}
    for r in results:
        if "error" in r:
            rows.append(f"| {r['arm']} | {r['mode']} | failed: {r['error']} |" + " |" * 11)
            continue
        base = full.get(r["mode"])
        vs = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        rss = _gib(r["main_rss_kb"]) if r["world"] == 1 else (
            _gib(r["main_rss_kb"]) + "; " + ", ".join(_gib(k) for k in r["rank_rss_kb"]))
        if r.get("cuda_max_allocated"):
            rss += " (cuda " + ", ".join(_mb(b) for b in r["cuda_max_allocated"]) + " MB)"
        rows.append(
            f"| {r['arm']} | {_mode(r)} | {_m(r['trained'])} "
            f"| {_mb(r['need'])} | {_mb(r['grads'])} | {_mb(r['state'])} | {r['ratio']:.3f} | {_mb(r['param_bytes'])} "
            f"| {_mb(r['ddp_bucket_bytes'])} | {rss} | {', '.join(_gib(k) for k in r['fit_start_rss_kb'])} "
            f"| {r['tokens_per_s']:,.0f} | {vs} | {r['loss']:.4f} |")
    return rows


def verdict(results: list[dict]) -> list[str]:
    out = []
    for mode in ("single", "ddp", "hf"):
        sel = [r for r in results if r.get("mode") == mode and r["arm"] in SELECTION_ARMS and "error" not in r]
        if sel:
            bad = [f"{r['arm']} ({r['ratio']:.2f})" for r in sel if r["ratio"] > 1.10]
            out.append(f"- {dict(single='1 process', ddp='2 ranks', hf='HF Trainer')[mode]}: grads + state within 10% of need for "
                       f"{len(sel) - len(bad)} of {len(sel)} selection arms" + (f"; over: {', '.join(bad)}" if bad else ""))
        full = next((r for r in results if r.get("mode") == mode and r["arm"] == "full" and "error" not in r), None)
        s25 = next((r for r in results if r.get("mode") == mode and r["arm"] == "spectrum25" and "error" not in r),
                   None)
        if full and s25:
            out.append(f"- {dict(single='1 process', ddp='2 ranks', hf='HF Trainer')[mode]}: Spectrum 25 "
                       f"{s25['tokens_per_s']:,.0f} tokens/s against full fine-tuning's {full['tokens_per_s']:,.0f}: "
                       f"{s25['tokens_per_s'] / full['tokens_per_s']:.2f}x")
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=list(MODELS), default="0.2b")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--modes", nargs="+", choices=["single", "ddp", "hf"], default=["single", "ddp"],
                   help="single: one process on Lightning; ddp: 2 ranks on Lightning; hf: one process on Hugging "
                        "Face's Trainer (every arm but lmsa, through lalr_lightning.hf.trainer_callback)")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per arm (default 6)")
    p.add_argument("--batch", type=int, default=1, help="sequences per batch per rank (default 1)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--gamma", type=int, default=2, help="LISA's middle blocks per draw (default 2)")
    p.add_argument("--lisa-every", type=int, default=2, help="LISA's every_n_steps (default 2: 3 draws in 6 steps)")
    p.add_argument("--surgical-k", type=int, default=None, help="first k blocks (default: layers // 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attn", default="eager", choices=["eager", "sdpa"],
                   help="attention (default eager for every arm: L-MSA's metric differentiates twice, which "
                        "torch's CPU flash attention cannot)")
    p.add_argument("--accelerator", default="cpu", help="cpu or gpu (then also torch.cuda.max_memory_allocated)")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, 2 steps of 2 x 16 tokens, LISA switching every step, single process, nothing "
                        "written")
    p.add_argument("--inline", action="store_true",
                   help="run the arms in this process (fast; peak RSS then is the process's, not the arm's)")
    p.add_argument("--out", default=None, help="markdown results (default benchmarks/results/memory.md; "
                                                "--quick: none)")
    p.add_argument("--json", default=None, help="also write the per-arm figures as JSON here")
    p.add_argument("--from-json", nargs="+", default=None, metavar="FILE",
                   help="run nothing: write the table of earlier runs' --json files (arms in the order given)")
    p.add_argument("--engines", nargs="+", choices=["zero2", "zero3", "fsdp2"], default=None,
                   help="instead: the Hugging Face Trainer under DeepSpeed ZeRO-2 / ZeRO-3 or FSDP2 on 2 CPU ranks, arms "
                        f"{', '.join(ENGINE_ARMS)} (docs/sharded.md)")
    p.add_argument("--engine-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    p.add_argument("--child-mode", choices=["single", "ddp", "hf"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        # LISA draws at both steps, so its release and keep modes differ already
        hf = ["hf"] if "hf" in args.modes else []
        args.model, args.steps, args.modes, args.seq, args.lisa_every = "tiny", 2, ["single", *hf], 16, 1
    if args.child:
        child(args)
        return []
    if args.engines:
        if args.arms == list(ARMS):
            args.arms = list(ENGINE_ARMS)
        if args.engine_out:
            engine_child(args)
            return []
        return engines_main(args, list(argv if argv is not None else sys.argv[1:]))
    warnings.filterwarnings("ignore")
    if args.from_json:
        latest = {(r["mode"], r["arm"]): r for f in args.from_json for r in json.loads(Path(f).read_text())}
        results = list(latest.values())  # a later file's run of an arm replaces an earlier one
        order = {(m, a): i for i, (m, a) in enumerate((m, a) for m in args.modes for a in args.arms)}
        results.sort(key=lambda r: order.get((r["mode"], r["arm"]), len(order)))
        lines, summary = table(results), verdict(results)
        print("\n".join(lines + summary))
        if args.out:
            write_markdown(Path(args.out), args, results, lines, summary, None, None)
        return results
    n_layers = MODELS[args.model]["num_hidden_layers"]
    if args.gamma > n_layers:
        raise SystemExit(f"--gamma {args.gamma} exceeds the model's {n_layers} layers")
    load = os.getloadavg()
    print(f"model {args.model} ({MODELS[args.model]}), {args.steps} steps, batch {args.batch} x {args.seq} tokens "
          f"per rank, AdamW lr {args.lr}; torch {torch.__version__}, {os.cpu_count()} cores; load average at start "
          f"{load[0]:.1f}", flush=True)
    out = args.out or (None if args.quick else str(ROOT / "benchmarks" / "results" / "memory.md"))
    fwd = [a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--inline",)]
    results = []
    t_all = time.perf_counter()
    for mode in args.modes:
        for arm in args.arms:
            if mode == "hf" and arm == "lmsa":  # its inner Adam and directions are metered on Lightning only
                continue
            t = time.perf_counter()
            if args.inline:
                with tempfile.TemporaryDirectory(prefix="memory_bench_") as d:
                    res = run_arm(args, arm, mode, d)
            else:
                res = run_in_child(fwd, arm, mode)
            res["load"] = os.getloadavg()[0]
            results.append(res)
            if out and not args.quick:  # written after every arm, so a cut-short run keeps what it measured
                write_markdown(Path(out), args, results, table(results), verdict(results), load, os.getloadavg())
            if "error" in res:
                print(f"{arm:11s} {mode:6s} FAILED: {res['error']}", flush=True)
            else:
                print(f"{arm:11s} {mode:6s} trained {_m(res['trained']):>10s}  grads {_mb(res['grads']):>7s} MB  "
                      f"state {_mb(res['state']):>7s} MB  (g+s)/need {res['ratio']:.3f}  "
                      f"rss {_gib(res['main_rss_kb'])}"
                      + ("" if res["world"] == 1 else " + " + "/".join(_gib(k) for k in res["rank_rss_kb"]))
                      + f" GiB  {res['tokens_per_s']:,.0f} tok/s  loss {res['loss']:.4f}  "
                      f"({time.perf_counter() - t:.0f} s)", flush=True)
    lines = table(results)
    print("\n" + "\n".join(lines))
    summary = verdict(results)
    print("\n".join(summary))
    end = os.getloadavg()
    print(f"load average at the end: {end[0]:.1f} (1 min), {end[1]:.1f} (5 min); "
          f"total {time.perf_counter() - t_all:.0f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if out:
        write_markdown(Path(out), args, results, lines, summary, load, end)
    return results


def write_markdown(path: Path, args, results, lines, summary, load, end) -> None:
    cfg = MODELS[args.model]
    n = next((r["params"] for r in results if "params" in r), None)
    lisa = {r["arm"]: r for r in results if r.get("arm") in ("lisa", "lisa_keep") and r.get("mode") == "single"
            and "error" not in r}
    text = [
        "# Memory and speed of the selection methods",
        "",
        "`python benchmarks/memory.py " + " ".join(a for a in (sys.argv[1:] if Path(sys.argv[0]).name == "memory.py"
                                                             else [f"--model {args.model}"])) + "`",
        "",
        f"LLaMA-shaped model from a `LlamaConfig` (hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
        f"MLP {cfg['intermediate_size']}, vocabulary {cfg['vocab_size']}, untied head"
        + (f": {n / 1e6:,.1f} M parameters" if n else "") + "), float32, random init; AdamW lr "
        f"{args.lr}, no weight decay; {args.steps} optimizer steps, each rank on one fixed batch of {args.batch} x "
        f"{args.seq} random tokens. LISA: gamma {args.gamma}, every {args.lisa_every} steps. Surgical: first "
        f"{args.surgical_k or max(1, cfg['num_hidden_layers'] // 4)} blocks (embedding joined to the first). CPU, "
        f"{os.cpu_count()} cores" + (f"; load average {load[0]:.1f} at the start, {end[0]:.1f} at the end." if load
                                      else " (assembled from the runs' --json files)."),
        "",
        "Bytes counted from the tensors on rank 0 (the ranks agree); grads at `on_before_optimizer_step` "
        "(what the backward computed) or, if larger, the gradients L-MSA forms outside the backward (a block's "
        "direction on a measurement batch, the Hamiltonian's gradient), AdamW state after the step (L-MSA's inner "
        "Adam included); need = 12 bytes per trained parameter. "
        "Peak RSS per process (`VmHWM`); under `ddp_spawn` the main process builds the model and spawns the ranks.",
        "",
        *lines,
        "",
        *summary,
    ]
    ok = [r for r in results if "error" not in r]
    if ok:
        text += ["", "Seconds from `setup` to the first batch (static decisions, the wrap, the optimizer): "
                 + ", ".join(f"{r['arm']} ({r['mode']}) {r.get('setup_s', float('nan')):.1f}" for r in ok) + "."]
        text += ["", "Load average (1 min) when each arm ended (2 cores: above ~2 the timings are slowed by other "
                 "processes; ? = not recorded): "
                 + ", ".join(f"{r['arm']} ({r['mode']}) " + (f"{r['load']:.1f}" if "load" in r else "?") for r in ok)
                 + "."]
    if len(lisa) == 2:
        text += ["", "AdamW state per step (MB), LISA release vs keep (1 process):", ""]
        for arm, r in lisa.items():
            text.append(f"- {arm}: " + ", ".join(_mb(s["state"]) for s in r["per_step"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(text) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
