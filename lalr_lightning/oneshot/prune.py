"""``prune``: the per-layer ratios and the prune, streamed from the checkpoint or in memory.

``python -m lalr_lightning prune MODEL_DIR --out OUT_DIR --sparsity 0.7 --criterion wanda
--preset alphapruning --calibration FILE`` streams the checkpoint: the model is built on the
meta device (no memory), only the modules before the first block (embeddings, rotary
position embeddings) are loaded to capture the calibration inputs, and then each block is
loaded from the safetensors files, calibrated, pruned, re-run (its outputs feed the next block)
and written to its own output shard before the next one is read
(:func:`lalr_lightning.core.pruning.calibration.run_blocks`). Memory: one block's weights, the
calibration activations and the embedding. ``--in-memory`` loads the whole model instead (the
same numbers; for comparison).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from lalr_lightning import progress
from lalr_lightning.choices import unknown
from lalr_lightning.core.pruning import criteria
from lalr_lightning.core.pruning.calibration import (
    capture_block_inputs,
    decoder_blocks,
    linear_modules,
    run_blocks,
    set_weight_matrix,
    weight_matrix,
)
from lalr_lightning.oneshot.checkpoint import (
    _INDEX,
    _Checkpoint,
    _finite,
    _first_line,
    _load_config,
    _load_tokenizer,
    _resolve_device,
    _resolve_dtype,
    _Streamed,
)
from lalr_lightning.oneshot.cut import Kept, block_key_test, check_depth_args, depth_record, renamer, write_cut_config
from lalr_lightning.oneshot.outdir import OutputClaim
from lalr_lightning.oneshot.ratios import explicit_ratios, read_ratios
from lalr_lightning.oneshot.text import calibration_samples

# files of a model directory that are weights (never copied: the output has its own shards)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt")


@dataclass
class PruneReport:
    """What :func:`prune_checkpoint` / :func:`prune_model` did: the target ratio and the achieved
    zero fraction of every pruned matrix (by parameter-module name), the metric values used for
    the ratios (empty: uniform), and the matrices' sizes."""

    ratios: dict[str, float] = field(default_factory=dict)
    sparsity: dict[str, float] = field(default_factory=dict)
    numels: dict[str, int] = field(default_factory=dict)
    metric: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    #: ``--remove-blocks``: the removed blocks (dense indices), every dense block's score, the criterion
    removed_blocks: list[int] = field(default_factory=list)
    block_scores: list = field(default_factory=list)
    block_criterion: str | None = None

    @property
    def overall(self) -> float:
        total = sum(self.numels.values())
        return sum(self.sparsity[k] * self.numels[k] for k in self.sparsity) / max(total, 1)

    def table(self) -> str:
        width = max((len(k) for k in self.sparsity), default=5)
        lines = [f"{'layer':<{width}}  {'target':>7}  {'sparsity':>8}"]
        lines += [f"{k:<{width}}  {self.ratios[k]:7.4f}  {v:8.4f}" for k, v in self.sparsity.items()]
        lines.append(f"{'overall':<{width}}  {self._target():7.4f}  {self.overall:8.4f}")
        return "\n".join(lines)

    def blocks_table(self) -> str:
        """One line per dense block: its score and whether it was removed (``--remove-blocks``)."""
        what = {"angular": "d(l, l+K)", "influence": "influence", "alpha": "mean alpha", "last": "score"}
        lines = [f"{'block':>5}  {what.get(self.block_criterion, 'score'):>10}  kept"]
        for i, v in enumerate(self.block_scores):
            score = "-" if v is None else f"{v:10.4f}"
            lines.append(f"{i:5d}  {score:>10}  {'removed' if i in self.removed_blocks else 'yes'}")
        lines.append(f"removed {len(self.removed_blocks)} of {len(self.block_scores)} blocks "
                     f"({self.block_criterion}): {self.removed_blocks}")
        return "\n".join(lines)

    def _target(self) -> float:
        total = sum(self.numels.values())
        return sum(self.ratios[k] * self.numels[k] for k in self.ratios) / max(total, 1)


# ----------------------------------------------------------------------------- ratios


@dataclass(frozen=True)
class Recipe:
    """How the per-layer ratios are chosen: uniform (every field None), HT-SR (``preset`` alphapruning or
    ``metric``, ``epsilon``), OWL (``preset="owl"``, ``owl_m``, ``owl_lambda``) or explicit (``ratios``:
    a file, a list of per-block ratios or ``{name: ratio}``, names of blocks or of matrices)."""

    preset: str | None = None
    metric: str | None = None
    epsilon: float | None = None
    owl_m: float | None = None
    owl_lambda: float | None = None
    ratios: object = None

    @property
    def owl(self) -> bool:
        return self.preset == "owl"

    @property
    def htsr(self) -> bool:
        return not self.owl and (self.preset is not None or self.metric is not None)


#: OWL's defaults: the paper's M = 5 and llm-compressor's example lambda 0.08
OWL_M, OWL_LAMBDA = 5.0, 0.08


def _check_recipe(recipe: Recipe, n: int, m: int, sparsity) -> None:
    from lalr_lightning.core.pruning.alphapruning import PRUNING_METRICS
    from lalr_lightning.core.pruning.owl import check_owl

    if m and (recipe.preset is not None or recipe.metric is not None or recipe.ratios is not None):
        raise ValueError(f"N:M sparsity prunes every layer to n/m = {n}/{m}; per-layer ratios (--preset / --metric / "
                         "--ratios) do not apply (AlphaPruning's and OWL's ratios are for unstructured sparsity)")
    if recipe.ratios is not None:
        given = [f for f, v in (("--sparsity", sparsity), ("--preset", recipe.preset), ("--metric", recipe.metric),
                                ("--epsilon", recipe.epsilon)) if v is not None]
        if given:
            raise ValueError(f"--ratios gives every layer's ratio; {', '.join(given)} does not apply: leave it out")
    if recipe.metric is not None and recipe.metric not in PRUNING_METRICS:
        raise unknown("--metric", recipe.metric, PRUNING_METRICS)
    if recipe.owl and (recipe.metric is not None or recipe.epsilon is not None):
        raise ValueError("--preset owl takes its ratios from the activations' outliers (--owl-m, --owl-lambda); "
                         "--metric and --epsilon are HT-SR's: leave them out")
    if not recipe.owl and (recipe.owl_m is not None or recipe.owl_lambda is not None):
        raise ValueError("--owl-m and --owl-lambda are OWL's: add --preset owl, or leave them out")
    if recipe.owl:
        check_owl(OWL_M if recipe.owl_m is None else recipe.owl_m,
                  OWL_LAMBDA if recipe.owl_lambda is None else recipe.owl_lambda)
    if recipe.epsilon is not None:
        if not recipe.htsr:
            raise ValueError("--epsilon spreads per-layer ratios (--preset or --metric); uniform pruning has none: "
                             "leave it out or add --preset alphapruning")
        if not 0.0 <= float(recipe.epsilon) <= 1.0:  # NaN fails too
            raise ValueError(f"--epsilon must be in [0, 1] (ratios spread over [1 - eps, 1 + eps] x the target), "
                             f"got {recipe.epsilon}")


def _check_prune_args(sparsity: float | None, criterion: str, n: int, m: int, preset, metric, epsilon=None,
                      blocksize: int | None = None, percdamp: float | None = None,
                      recipe: Recipe | None = None) -> float:
    """Every argument of a prune that needs no file, checked before anything is read or written;
    returns the target sparsity (``n / m`` for N:M; 0.5 when left out; the ratios' own with --ratios)."""
    recipe = recipe or Recipe(preset, metric, epsilon)
    n, m = criteria.check_nm(n, m)
    if criterion not in criteria.CRITERIA:
        raise unknown("criterion", criterion, criteria.CRITERIA)
    _check_recipe(recipe, n, m, sparsity)
    if m and sparsity is not None and not math.isclose(float(sparsity), n / m):
        raise ValueError(f"N:M sparsity {n}:{m} prunes exactly n/m = {n / m:g} of every layer; --sparsity {sparsity} "
                         "does not apply: leave it out")
    sparsity = n / m if m else 0.5 if sparsity is None else float(sparsity)
    if not m and not (0.0 <= sparsity < 1.0):
        raise ValueError(f"--sparsity must be in [0, 1) (the fraction of the blocks' linear weights set to zero), "
                         f"got {sparsity}")
    used = criterion == "sparsegpt"
    for flag, value in (("--blocksize", blocksize), ("--percdamp", percdamp)):
        if value is not None and not used:
            raise ValueError(f"{flag} is SparseGPT's; --criterion {criterion} does not use it: leave it out")
    if blocksize is not None and (isinstance(blocksize, bool) or int(blocksize) != blocksize or blocksize < 1):
        raise ValueError(f"--blocksize must be an integer >= 1 (SparseGPT's columns per block), got {blocksize}")
    if percdamp is not None and not (0.0 <= float(percdamp) < math.inf):
        raise ValueError(f"--percdamp must be >= 0 (SparseGPT adds percdamp x mean(diag H) to the diagonal), "
                         f"got {percdamp}")
    if used and m and (blocksize or 128) % m:
        raise ValueError(f"N:M sparsity with m={m} needs --blocksize ({blocksize or 128}) to be a multiple of m")
    return sparsity


def _ratio_settings(preset, metric, epsilon):
    """(metric, epsilon, fit, filter_zeros, block_average) of HT-SR ratios, or None (uniform, OWL or
    explicit ratios)."""
    if preset is None and metric is None or preset == "owl":
        return None
    from lalr_lightning.core.pruning.settings import PRESETS

    if preset not in PRESETS:
        raise unknown("preset", preset, [p for p in PRESETS if p], show=repr)
    fill = PRESETS[preset]
    eps = fill["epsilon"] if epsilon is None else float(epsilon)
    return (fill["metric"] if metric is None else metric, eps, fill["fit"], fill["filter_zeros"],
            fill["block_average"])


def _block_metric(block: nn.Module, qual: str, metric: str, fit: str, filter_zeros: bool) -> dict[str, float]:
    from lalr_lightning.core.model.layers import Layer
    from lalr_lightning.core.spectral.htsr import layer_fits

    layers = [Layer(f"{qual}.{n}", "hf_conv1d" if type(mod).__name__ == "Conv1D" else "linear", mod)
              for n, mod in linear_modules(block).items()]
    fits = layer_fits(layers, fit=fit, metrics=[metric], min_evals=1, filter_zeros=filter_zeros)
    values = {f.name: f.value(metric) for f in fits}
    bad = {k: v for k, v in values.items() if not math.isfinite(v)}
    if bad:
        raise ValueError(f"metric {metric!r} is not finite for {sorted(bad)[:3]} (all-zero or constant weights?); "
                         "choose another metric or prune uniformly")
    return values


def _ratios(settings, metric_values: dict[str, float], groups: list[list[str]], numels: dict[str, int],
            sparsity: float) -> dict[str, float]:
    from lalr_lightning.core.pruning.alphapruning import block_average_values, pruning_ratios

    names = list(numels)
    if settings is None:
        return {k: float(sparsity) for k in names}
    _, eps, _, _, block_average = settings
    values = block_average_values(metric_values, groups) if block_average else dict(metric_values)
    r = pruning_ratios([values[k] for k in names], [numels[k] for k in names], sparsity, eps)
    return dict(zip(names, r.tolist()))


def _owl_shares(blocks, inputs: list, m: float, materialize=None, release=None) -> list[float]:
    """OWL's outlier share ``D`` of every block on the dense model (the callback's ``preset='owl'`` uses
    the same function)."""
    from lalr_lightning.core.pruning.owl import block_shares

    return block_shares(blocks, inputs, m, materialize=materialize, release=release)


def _plan_ratios(report: PruneReport, recipe: Recipe, settings, sparsity: float, groups: list[list[str]],
                 path: str, owl_pass) -> None:
    """``report.ratios`` (and ``report.metric``: the HT-SR metric or OWL's ``D`` of each matrix's block)
    from the recipe; ``owl_pass(m)`` measures OWL's shares when the recipe is OWL's."""
    if recipe.ratios is not None:
        report.ratios = explicit_ratios(read_ratios(recipe.ratios), groups, path)
    elif recipe.owl:
        from lalr_lightning.core.pruning.owl import owl_ratios

        shares = owl_pass(OWL_M if recipe.owl_m is None else float(recipe.owl_m))
        per_block = owl_ratios(shares, sparsity, OWL_LAMBDA if recipe.owl_lambda is None else float(recipe.owl_lambda))
        report.metric = {k: d for d, names in zip(shares, groups) for k in names}
        report.ratios = {k: r for r, names in zip(per_block, groups) for k in names}
    else:
        report.ratios = _ratios(settings, report.metric, groups, report.numels, sparsity)


# ----------------------------------------------------------------------------- prune


def _pruner(report: PruneReport, qual_of, criterion: str, n: int, m: int, blocksize: int, percdamp: float):
    def prune_block(index: int, block: nn.Module, stats) -> None:
        for name, mod in linear_modules(block).items():
            qual = qual_of(index, name)
            w = weight_matrix(mod)
            st = None if stats is None else stats.pop(name)
            new, _ = criteria.prune_weight(w, criterion, report.ratios[qual], st, n=n, m=m,
                                              blocksize=blocksize, percdamp=percdamp)
            del st
            set_weight_matrix(mod, new)
            del new
            if not _finite(weight_matrix(mod)):  # e.g. SparseGPT's update overflowing float16
                raise ValueError(f"pruning made {qual} non-finite in {w.dtype}; prune with --dtype float32")
            report.sparsity[qual] = float((weight_matrix(mod) == 0).sum()) / w.numel()
    return prune_block


def _batches(samples: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    return [samples[i:i + batch_size] for i in range(0, samples.shape[0], batch_size)]


def prune_model(
    model: nn.Module,
    samples: torch.Tensor | None,
    *,
    sparsity: float | None = None,
    criterion: str = "wanda",
    n: int = 0,
    m: int = 0,
    preset: str | None = None,
    metric: str | None = None,
    epsilon: float | None = None,
    batch_size: int = 8,
    blocksize: int | None = None,
    percdamp: float | None = None,
    owl_m: float | None = None,
    owl_lambda: float | None = None,
    ratios=None,
) -> PruneReport:
    """Prune a loaded Hugging Face causal LM in place, block by block (the in-memory twin of
    :func:`prune_checkpoint`; the same ratios and masks). ``samples``: ``(n, seq_len)`` token ids
    (None for magnitude without OWL). ``sparsity``: default 0.5 (``n / m`` with N:M, which fixes it);
    ``blocksize`` / ``percdamp``: SparseGPT's (default 128 and 0.01). Per-layer ratios: ``preset``
    (``"alphapruning"``, ``"owl"`` with ``owl_m`` / ``owl_lambda``), ``metric`` / ``epsilon``, or
    ``ratios`` (a file, a per-block list or ``{name: ratio}``, :func:`read_ratios`)."""
    recipe = Recipe(preset, metric, epsilon, owl_m, owl_lambda, ratios)
    sparsity = _check_prune_args(sparsity, criterion, n, m, preset, metric, epsilon, blocksize, percdamp, recipe)
    blocksize, percdamp = 128 if blocksize is None else int(blocksize), 0.01 if percdamp is None else float(percdamp)
    settings = _ratio_settings(preset, metric, epsilon)
    t0 = time.perf_counter()
    path, blocks = decoder_blocks(model)
    report = PruneReport()
    groups = []
    for i, blk in enumerate(blocks):
        mods = linear_modules(blk)
        groups.append([f"{path}.{i}.{k}" for k in mods])
        report.numels.update({f"{path}.{i}.{k}": mod.weight.numel() for k, mod in mods.items()})
        if settings is not None:
            report.metric.update(_block_metric(blk, f"{path}.{i}", settings[0], settings[2], settings[3]))
    needs = criteria.needs_stats(criterion)
    if (needs or recipe.owl) and samples is None:
        raise ValueError(f"criterion {criterion!r}{' with OWL' if recipe.owl else ''} needs calibration samples")
    use_cache = getattr(model.config, "use_cache", None)
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device

        def capture():
            return capture_block_inputs(model, _batches(samples, batch_size), device=device)

        _plan_ratios(report, recipe, settings, sparsity, groups, path, lambda m_: _owl_shares(blocks, capture(), m_))
        inputs = capture() if needs else []
        run_blocks(blocks, inputs, _pruner(report, lambda i, k: f"{path}.{i}.{k}", criterion, n, m, blocksize,
                                           percdamp),
                   stats=needs, hessian=criterion == "sparsegpt")
        del inputs
    finally:
        model.train(was_training)
        if use_cache is not None:
            model.config.use_cache = use_cache
    report.seconds = time.perf_counter() - t0
    return report


def _check_out(model_dir: Path, out_dir: Path) -> None:
    if out_dir.resolve() == model_dir.resolve():
        raise ValueError("--out must be a new directory, not the model directory itself")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"--out {out_dir} exists and is not an empty directory; choose a new one")


def _available_bytes(device: torch.device) -> int | None:
    """Memory a new allocation can take on ``device`` now (None: unknown)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None


def _check_calibration_memory(n_samples: int, seq_len: int, hidden: int, dtype: torch.dtype,
                              device: torch.device) -> None:
    """Refuse a calibration whose activations (one copy: ``run_blocks`` replaces each batch by
    its output) cannot fit, before drawing it: a clear line instead of an allocator's."""
    size = torch.finfo(dtype).bits // 8
    need = n_samples * seq_len * (hidden * size + 8)  # hidden states and the token ids
    free = _available_bytes(device)
    if free is not None and need > free:
        raise ValueError(
            f"--n-samples {n_samples} x --seq-len {seq_len} calibration tokens need {need / 2**30:.1f} GiB for their "
            f"activations (hidden {hidden} x {size} bytes each, plus the ids) and {device} has {free / 2**30:.1f} GiB "
            "free; lower --n-samples or --seq-len")


def _copy_side_files(model_dir: Path, out_dir: Path, overwrite: bool = True) -> None:
    """config, generation config, tokenizer files: everything but the weights and their index."""
    for f in model_dir.iterdir():
        if (f.is_file() and f.suffix not in _WEIGHT_SUFFIXES and not f.name.endswith(".index.json")
                and (overwrite or not (out_dir / f.name).exists())):
            shutil.copy2(f, out_dir / f.name)


def _write_report(out_dir: Path, report: PruneReport, settings: dict) -> None:
    (out_dir / "pruning.json").write_text(json.dumps(
        {**settings, "ratios": report.ratios, "achieved": report.sparsity, "overall": report.overall,
         "metric_values": report.metric}, indent=2) + "\n")


def _verify_output(out_dir: Path, source: _Checkpoint | None, config, rename=None, uniform: bool = True) -> None:
    """The written directory before it is renamed into place: every shard readable, every tensor
    the config implies present with its shape (and, for a streamed prune, exactly the source's
    tensors in their stored dtypes; ``rename``: a source key's name in the output, None: not
    written, for a prune that removed blocks)."""
    written = _Checkpoint(out_dir)
    check = _Streamed(out_dir, config, torch.device("cpu"), torch.float32, ckpt=written, uniform=uniform)
    check.validate()
    if source is None:
        return
    rename = rename or (lambda k: k)
    expect = {rename(k): k for k in source.where if rename(k) is not None}  # output key -> source key
    lost = sorted(set(expect) - set(written.where))
    extra = sorted(set(written.where) - set(expect))
    changed = [k for k, src in expect.items() if k in written.where
               and (written.shapes[k] != source.shapes[src] or written.where[k][1] != source.where[src][1])]
    if lost or extra or changed:
        raise RuntimeError(f"the written model differs from the source in its tensors (missing {lost[:3]}, extra "
                           f"{extra[:3]}, other shape or dtype {changed[:3]}); please report this")


def _settings_record(criterion: str, sparsity: float, n: int, m: int, settings, recipe: Recipe) -> dict:
    """What pruning.json records of the settings."""
    out = {"criterion": criterion, "sparsity": sparsity, "n": n, "m": m, "preset": recipe.preset,
           "metric": None if settings is None else settings[0], "epsilon": None if settings is None else settings[1]}
    if recipe.owl:
        out.update(owl_m=OWL_M if recipe.owl_m is None else recipe.owl_m,
                   owl_lambda=OWL_LAMBDA if recipe.owl_lambda is None else recipe.owl_lambda)
    if recipe.ratios is not None:
        out["ratios_from"] = str(recipe.ratios) if isinstance(recipe.ratios, (str, os.PathLike)) else "given"
    return out


def _samples(model_dir: Path, calibration, n_samples: int, seq_len: int, seed: int, text_field: str, say):
    samples = calibration_samples(_load_tokenizer(model_dir), calibration, n_samples, seq_len, seed, text_field)
    say(f"calibration: {samples.shape[0]} windows of {samples.shape[1]} tokens from {calibration}")
    return samples


def _check_run_args(n_samples, seq_len, batch_size, ratios=None) -> None:
    if ratios is not None:
        read_ratios(ratios)  # the file's format now; its names once the blocks are known
    for flag, value in (("--n-samples", n_samples), ("--seq-len", seq_len), ("--batch-size", batch_size)):
        if isinstance(value, bool) or int(value) != value or value < 1:
            raise ValueError(f"{flag} must be an integer >= 1, got {value}")


def _check_calibration(criterion: str | None, recipe: Recipe, calibration, config, seq_len: int, say,
                       block_criterion: str | None = None) -> bool:
    """Whether the prune reads calibration data (Wanda, SparseGPT, OWL's ratios, the data-driven block
    criteria); the file and the window length checked against it. ``criterion`` None: no unstructured
    pruning (``--remove-blocks`` alone)."""
    from lalr_lightning.core.pruning.depth import DATA_CRITERIA

    stats = criterion is not None and criteria.needs_stats(criterion)
    owl = criterion is not None and recipe.owl
    needs = stats or owl or block_criterion in DATA_CRITERIA
    why = (f"criterion {criterion!r}" if stats else "--preset owl" if owl
           else f"--block-criterion {block_criterion}")
    if needs and calibration is None:
        raise ValueError(f"{why} needs --calibration FILE (text or JSON lines, e.g. a C4 shard)")
    if calibration is not None and Path(calibration).is_dir():
        raise ValueError(f"--calibration {calibration} is a directory; give one text file (.txt, .json or .jsonl) "
                         "in it, e.g. a C4 shard")
    if calibration is not None and not Path(calibration).is_file():
        raise FileNotFoundError(f"no such calibration file: {calibration}" + (
            "" if needs else f" ({'--criterion ' + criterion if criterion else '--block-criterion ' + str(block_criterion)}"
                             " does not read one: leave --calibration out)"))
    if not needs and calibration is not None:
        who = (f"--criterion {criterion}{' (and --block-criterion ' + block_criterion + ')' if block_criterion else ''}"
               " prunes by" if criterion else f"--block-criterion {block_criterion} reads")
        say(f"note: {who} the weights alone; --calibration {calibration} (and --n-samples, "
            "--seq-len, --seed, --batch-size) are not used")
    max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if needs and max_pos and seq_len > max_pos:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's {max_pos} positions; lower --seq-len")
    return needs


def prune_checkpoint(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    sparsity: float | None = None,
    criterion: str | None = None,
    n: int = 0,
    m: int = 0,
    preset: str | None = None,
    metric: str | None = None,
    epsilon: float | None = None,
    remove_blocks: int | None = None, block_criterion: str | None = None,
    calibration: str | os.PathLike | None = None,
    n_samples: int = 128,
    seq_len: int = 2048,
    seed: int = 0,
    text_field: str = "text",
    device: str | None = None,
    dtype: str = "auto",
    batch_size: int = 8,
    blocksize: int | None = None,
    percdamp: float | None = None,
    in_memory: bool = False,
    owl_m: float | None = None,
    owl_lambda: float | None = None,
    ratios=None,
    log=None,
) -> PruneReport:
    """Prune the causal LM in ``model_dir`` and write the pruned model to ``out_dir`` (module
    docstring). Returns the :class:`PruneReport`; ``log`` receives progress lines. Per-layer ratios
    as :func:`prune_model`'s; ``criterion`` default ``"wanda"``. ``remove_blocks=K, block_criterion=...``
    removes ``K`` whole decoder blocks (:func:`_remove_blocks_streamed`).

    Everything that can be checked is checked before the first block: the arguments, the
    architecture, every tensor the config implies (present, with its shape) and every value
    (finite), the calibration file and whether its activations fit. The output is written to a
    temporary sibling of ``out_dir`` and renamed into place once complete and checked
    (:class:`lalr_lightning.oneshot.outdir.OutputClaim`): a failure or an interrupt leaves no ``out_dir``
    (or the empty one that was there), and a second run into the same ``out_dir`` is refused.
    """
    say = log or (lambda s: None)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    # 1. arguments, the architecture and every tensor: nothing is written, nothing calibrated yet
    recipe = Recipe(preset, metric, epsilon, owl_m, owl_lambda, ratios)
    depth, unstructured, criterion, sparsity = _check_what(remove_blocks, block_criterion, in_memory, sparsity,
                                                           criterion, n, m, recipe, blocksize, percdamp)
    _check_run_args(n_samples, seq_len, batch_size, ratios)
    settings = _ratio_settings(preset, metric, epsilon)
    dev = _resolve_device(device)
    config = _load_config(model_dir)
    _check_out(model_dir, out_dir)
    needs = _check_calibration(criterion, recipe, calibration, config, seq_len, say, block_criterion if depth else None)
    ckpt, cdtype, sm, remove_blocks = _open_checked(model_dir, config, dev, dtype, needs, depth, remove_blocks,
                                                    n_samples, seq_len, say)
    written = _settings_record(criterion, sparsity, n, m, settings, recipe) if unstructured else {"criterion": None}
    # 2. claim --out (or learn who holds it), then work in a temporary sibling
    what = (f"--criterion {criterion} --sparsity {sparsity:g}" if unstructured else f"--remove-blocks {remove_blocks}")
    claim = OutputClaim(out_dir, command=f"prune {model_dir} --out {out_dir} {what}", log=say)
    with claim as tmp:
        samples = _samples(model_dir, calibration, n_samples, seq_len, seed, text_field, say) if needs else None
        t0 = time.perf_counter()
        if depth:
            report = _remove_blocks_streamed(sm, tmp, samples, remove_blocks, block_criterion, unstructured, settings,
                                             recipe, sparsity, criterion, n, m, batch_size, blocksize, percdamp, say)
        elif in_memory:
            report = _prune_in_memory(model_dir, tmp, samples, cdtype, dev, ckpt.stored_dtype(), sparsity=sparsity,
                                      criterion=criterion, n=n, m=m, batch_size=batch_size, blocksize=blocksize,
                                      percdamp=percdamp, **_recipe_kwargs(recipe))
        else:
            report = _prune_streamed(sm, tmp, samples, settings, recipe, sparsity, criterion, n, m, batch_size,
                                     *_knobs(blocksize, percdamp), say)
        _copy_side_files(model_dir, tmp, overwrite=not in_memory)  # save_pretrained wrote its own config
        written, rename, config = _finish_cut(model_dir, tmp, sm, report, written, remove_blocks) if depth else (
            written, None, config)  # a cut model's config, and its tensors' names for the check
        report.seconds = time.perf_counter() - t0
        _write_report(tmp, report, written)
        _verify_output(tmp, None if in_memory else ckpt, config, rename=rename, uniform=needs or not depth)
        claim.commit()
    return report


def _open_checked(model_dir: Path, config, dev, dtype, needs: bool, depth: bool, remove_blocks, n_samples: int,
                  seq_len: int, say):
    """The checkpoint, the compute dtype and the streamed model, every tensor checked (present, with
    its shape, finite), ``--remove-blocks`` against the block count and the calibration's memory."""
    ckpt = _Checkpoint(model_dir)
    cdtype = _resolve_dtype(dtype, dev, ckpt.stored_dtype())
    sm = _Streamed(model_dir, config, dev, cdtype, ckpt=ckpt, uniform=needs or not depth)
    if depth:
        from lalr_lightning.core.pruning.depth import check_remove_blocks

        remove_blocks = check_remove_blocks(remove_blocks, len(sm.blocks))
    sm.validate()
    ckpt.check_values(log=say)
    if needs:
        hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 0
        _check_calibration_memory(int(n_samples), int(seq_len), int(hidden), cdtype, dev)
    return ckpt, cdtype, sm, remove_blocks


def _knobs(blocksize, percdamp) -> tuple[int, float]:
    """SparseGPT's blocksize and percdamp, their defaults filled in."""
    return 128 if blocksize is None else int(blocksize), 0.01 if percdamp is None else float(percdamp)


def _check_what(remove_blocks, block_criterion, in_memory, sparsity, criterion, n, m, recipe: Recipe, blocksize,
                percdamp):
    """``(depth, unstructured, criterion, sparsity)``: whether blocks are removed, whether the
    (kept) blocks' weights are pruned, and by which criterion to which target (checked)."""
    depth = check_depth_args(remove_blocks, block_criterion, in_memory, sparsity, criterion, n, m, recipe, blocksize,
                              percdamp)
    unstructured = not depth or sparsity is not None or bool(m) or bool(n) or recipe.ratios is not None
    criterion = (criterion or "wanda") if unstructured else None
    if unstructured:
        sparsity = _check_prune_args(sparsity, criterion, n, m, recipe.preset, recipe.metric, recipe.epsilon,
                                     blocksize, percdamp, recipe)
    return depth, unstructured, criterion, sparsity


def _finish_cut(model_dir: Path, tmp: Path, sm: _Streamed, report: PruneReport, written: dict, k: int):
    """A depth prune's config.json (blocks cut), its pruning.json record, the renaming of the source's
    tensors and the cut config for the output check."""
    kept = [i for i in range(len(sm.blocks)) if i not in report.removed_blocks]
    write_cut_config(model_dir, tmp, kept, len(sm.blocks))
    return {**written, **depth_record(report, kept, k)}, renamer(sm, kept), _load_config(tmp)


def _recipe_kwargs(recipe: Recipe) -> dict:
    return dict(preset=recipe.preset, metric=recipe.metric, epsilon=recipe.epsilon, owl_m=recipe.owl_m,
                owl_lambda=recipe.owl_lambda, ratios=recipe.ratios)


def _prune_in_memory(model_dir: Path, tmp: Path, samples, cdtype, dev, stored, **kw) -> PruneReport:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=cdtype).to(dev)
    report = prune_model(model, samples, **kw)
    from safetensors import SafetensorError

    try:
        model.to(stored or torch.float32).save_pretrained(str(tmp))
    except (OSError, SafetensorError) as e:  # a full disk: safetensors raises its own error, naming the OS's
        raise OSError(f"cannot write the pruned model into {tmp}: {_first_line(e)}") from None
    return report


def _streamed_ratios(sm: _Streamed, samples, settings, recipe: Recipe, sparsity: float, batch_size: int,
                     report: PruneReport) -> None:
    """Sizes from the meta skeleton; the HT-SR metric from each block loaded in turn, or OWL's shares
    from a dense calibration pass (each block loaded, measured, run and freed); then the ratios."""
    nb = len(sm.blocks)
    groups = []
    for i in range(nb):
        mods = linear_modules(sm.blocks[i])
        groups.append([f"{sm.path}.{i}.{k}" for k in mods])
        report.numels.update({f"{sm.path}.{i}.{k}": weight_matrix(mod).numel() for k, mod in mods.items()})
    if settings is not None:
        for i in progress.bar(range(nb), desc="HT-SR metrics", unit="block"):
            report.metric.update(_block_metric(sm.block(i), f"{sm.path}.{i}", settings[0], settings[2], settings[3]))
            sm.free(i)

    def owl_pass(m_: float) -> list[float]:
        return _owl_shares(nb, _stem_inputs(sm, samples, batch_size), m_, materialize=sm.block,
                           release=lambda i, block: sm.free(i))

    _plan_ratios(report, recipe, settings, sparsity, groups, sm.path, owl_pass)


def _stem_inputs(sm: _Streamed, samples, batch_size: int) -> list:
    sm.load_stem()
    inputs = capture_block_inputs(sm.model, _batches(samples, batch_size), device=sm.device)
    sm.free_stem()
    return inputs


def _prune_streamed(sm: _Streamed, tmp: Path, samples, settings, recipe, sparsity, criterion, n, m, batch_size,
                    blocksize, percdamp, say, prune: bool = True) -> PruneReport:
    """Prune and write every block of ``sm`` (a :class:`_Streamed`, or a :class:`Kept` view of the
    blocks a depth prune keeps, whose tensors are renamed to their new indices); ``prune=False``:
    copy the blocks' stored tensors as they are."""
    from safetensors.torch import save_file

    nb = len(sm.blocks)
    report = PruneReport()
    rename = getattr(sm, "rename", lambda k: k)
    if prune:
        _streamed_ratios(sm, samples, settings, recipe, sparsity, batch_size, report)
    width = len(str(nb + 1))
    total = nb + 1

    def shard(j: int) -> str:
        return f"model-{j:0{max(5, width)}d}-of-{total:0{max(5, width)}d}.safetensors"

    weight_map: dict[str, str] = {}
    size = 0

    def write(j: int, tensors: dict[str, torch.Tensor]) -> None:
        nonlocal size
        name = shard(j)
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / name), metadata={"format": "pt"})
        except Exception as e:  # noqa: BLE001 -- OSError (full disk), SafetensorError
            raise OSError(f"cannot write {tmp / name}: {_first_line(e)}") from None
        weight_map.update({k: name for k in tensors})
        size += sum(v.numel() * v.element_size() for v in tensors.values())

    dense = getattr(sm, "dense_index", lambda i: i)

    def release(i: int, block: nn.Module) -> None:
        keys = sm.block_keys(i)
        src = sm.key(f"{sm.path}.{dense(i)}") + "."
        state = {src + k: v for k, v in block.state_dict().items()}
        out = {}
        for k in keys:  # every stored tensor of the block, in its stored dtype
            out[rename(k)] = state[k].detach().to("cpu", sm.ckpt.dtype(k)) if k in state else sm.ckpt.get(k)
        write(i + 2, out)
        del state, out
        sm.free(i)
        say(f"block {i + 1}/{nb} pruned")

    if prune:
        stats = criteria.needs_stats(criterion)
        # run_blocks replaces each batch by the block's output in this list: one copy of the activations
        inputs = _stem_inputs(sm, samples, batch_size) if stats else []
        run_blocks(nb, inputs, _pruner(report, lambda i, k: f"{sm.path}.{i}.{k}", criterion, n, m, blocksize,
                                       percdamp),
                   stats=stats, hessian=criterion == "sparsegpt", materialize=sm.block, release=release)
        del inputs
    else:
        for i in range(nb):  # the stored tensors, bit for bit, one block at a time
            write(i + 2, {rename(k): sm.ckpt.get(k) for k in sm.block_keys(i)})
    in_blocks = block_key_test(sm)
    write(1, {k: sm.ckpt.get(k) for k in sm.ckpt.where if not in_blocks(k)})
    (tmp / _INDEX).write_text(json.dumps({"metadata": {"total_size": size},
                                          "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    return report


# ----------------------------------------------------------------------------- removing whole blocks


def _block_scores(sm: _Streamed, samples, k: int, block_criterion: str, batch_size: int) -> list:
    """Every dense block's score (``core/pruning/depth.py``): its Block Influence, the angular distance
    of the run of ``k`` starting at it (None where no run of ``k`` starts), its mean alpha, or None
    (``last``). The blocks are loaded one at a time."""
    from lalr_lightning.core.pruning import depth

    nb = len(sm.blocks)
    if block_criterion in depth.DATA_CRITERIA:
        inputs = _stem_inputs(sm, samples, batch_size)
        influence, states = depth.score_pass(nb, inputs, sm.block, lambda i, b: sm.free(i))
        del inputs
        if block_criterion == "influence":
            return influence
        return depth.angular_distances(states, k) + [None] * (k - 1)
    if block_criterion == "alpha":
        from lalr_lightning.core.pruning.settings import PRESETS

        fill = PRESETS["alphapruning"]  # AlphaPruning's fit: alpha by the peak, every eigenvalue
        scores = []
        for i in progress.bar(range(nb), desc="HT-SR alpha", unit="block"):
            values = _block_metric(sm.block(i), f"{sm.path}.{i}", "alpha", fill["fit"], fill["filter_zeros"])
            sm.free(i)
            scores.append(sum(values.values()) / len(values))
        return scores
    return [None] * nb


def _remove_blocks_streamed(sm: _Streamed, tmp: Path, samples, k: int, block_criterion: str, unstructured: bool,
                            settings, recipe, sparsity, criterion, n, m, batch_size, blocksize, percdamp,
                            say) -> PruneReport:
    """``--remove-blocks K`` (``core/pruning/depth.py``): score the dense blocks (streamed, one block at
    a time), choose the ``k`` to remove, then write the kept ones renumbered and everything outside
    the blocks. The kept blocks are copied as stored, or, when ``unstructured``, pruned as without
    ``--remove-blocks`` and calibrated on the cut model (the removed blocks skipped); the caller
    writes the config with ``num_hidden_layers`` reduced by ``k`` and its per-block lists cut."""
    from lalr_lightning.core.pruning.depth import choose_removed

    nb = len(sm.blocks)
    scores = _block_scores(sm, samples, k, block_criterion, batch_size)
    removed = choose_removed(block_criterion, scores, k, nb)
    kept = [i for i in range(nb) if i not in removed]
    say(f"removing blocks {removed} of {nb} ({block_criterion}); {len(kept)} stay")
    report = _prune_streamed(Kept(sm, kept), tmp, samples, settings, recipe, sparsity, criterion, n, m, batch_size,
                             *_knobs(blocksize, percdamp), say, prune=unstructured)
    report.removed_blocks, report.block_scores, report.block_criterion = removed, scores, block_criterion
    return report
