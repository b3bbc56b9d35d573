"""``python -m lalr_lightning analyze MODEL``: a per-layer HT-SR spectral report (alpha, ESD plots)
of a model, a checkpoint or a Hugging Face directory.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lalr_lightning.cli.common import _first_line, _prog

if TYPE_CHECKING:  # imported on first use: a command loads torch only once it needs it
    import torch
    from torch import nn

__all__ = [
    "analyze_main",
    "load_for_analysis",
]


def _shell():
    """A module tree node rebuilt from a state dict: one Linear/Conv shell per weight matrix, so a
    checkpoint can be analyzed without the class that wrote it (defined on first use: torch is
    imported only once a command needs it)."""
    global _Shell
    if _Shell is None:
        from torch import nn

        class _Shell(nn.Module):  # noqa: N801 -- the name shown by repr(module)
            pass
    return _Shell()


_Shell = None


def _module_from_state_dict(state: dict[str, torch.Tensor]) -> nn.Module:
    import torch
    from torch import nn

    root = _shell()
    for key, w in state.items():
        if not key.endswith("weight") or not isinstance(w, torch.Tensor) or w.ndim not in (2, 3, 4):
            continue
        if not w.is_floating_point():
            continue
        path = key[: -len(".weight")] if key.endswith(".weight") else key
        if w.ndim == 2:
            mod: nn.Module = nn.Linear(1, 1, bias=False)
        elif w.ndim == 3:
            mod = nn.Conv1d(1, 1, 1, bias=False)
        else:
            mod = nn.Conv2d(1, 1, 1, bias=False)
        mod.weight = nn.Parameter(w.detach().float(), requires_grad=False)
        parent = root
        parts = path.split(".")
        for part in parts[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, _shell())
            parent = getattr(parent, part)
        parent.add_module(parts[-1], mod)
    return root


def load_for_analysis(spec: str, *, pretrained: bool = False, weights_only: bool = True) -> nn.Module:
    """A module from a timm model name, a Lightning checkpoint / torch or safetensors state
    dict file, or a Hugging Face model directory.

    Torch files are read with ``weights_only=True``: a file holding other Python objects (a
    pickled ``nn.Module``, custom classes) is refused, since unpickling it runs code named in
    the file; ``weights_only=False`` (``analyze --unsafe-load``) reads it when you trust it.
    """
    from torch import nn

    from lalr_lightning.models.base import load_checkpoint_file

    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{spec} is a directory without config.json; expected a Hugging Face model directory")
        try:
            from transformers import AutoModel, AutoModelForCausalLM
        except ImportError as e:
            raise ImportError('analyzing a Hugging Face directory needs transformers: pip install "lalr_lightning[text]"') from e
        from lalr_lightning.oneshot.checkpoint import _load_config

        config = _load_config(path)  # a config.json that does not read: one line, as prune says it
        try:
            try:  # a causal LM keeps its lm_head; other architectures load as their base model
                return AutoModelForCausalLM.from_pretrained(str(path), config=config, local_files_only=True)
            except ValueError:
                return AutoModel.from_pretrained(str(path), config=config, local_files_only=True)
        except pickle.UnpicklingError as e:  # a .bin holding Python objects: transformers' weights_only refusal
            from lalr_lightning.models.base import unsafe_weights_in

            raise unsafe_weights_in(path, e) from None
    if path.is_file():
        state = load_checkpoint_file(path, weights_only=weights_only, unsafe_hint=(
            "pass --unsafe-load to analyze (Python: load_for_analysis(..., weights_only=False))"))
        if isinstance(state, dict) and "state_dict" in state:  # Lightning checkpoint
            state = state["state_dict"]
        if isinstance(state, nn.Module):
            return state
        if not isinstance(state, dict):
            raise ValueError(f"{spec}: expected a state dict or a Lightning checkpoint, found {type(state).__name__}")
        return _module_from_state_dict(state)
    if os.sep in spec or spec.endswith((".ckpt", ".pt", ".pth", ".bin", ".safetensors")):
        raise FileNotFoundError(f"no such file or directory: {spec}")
    import timm

    if not timm.is_model(spec):
        raise ValueError(
            f"{spec!r} is neither a file, a directory, nor a timm model name; "
            "see timm.list_models() for names, or pass a checkpoint path"
        )
    if not pretrained:
        return timm.create_model(spec)
    offline = _hub_offline()
    if offline:  # the weights can only come from the local cache: say so now, not after retries
        import huggingface_hub.constants

        huggingface_hub.constants.HF_HUB_OFFLINE = True  # read at call time by huggingface_hub
        os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        return timm.create_model(spec, pretrained=True)
    except Exception as e:  # noqa: BLE001 -- any download failure, offline, is the missing cache
        if not offline:
            raise
        raise RuntimeError(
            f"{spec} --pretrained: {offline}, and its weights are not in the local cache "
            f"({os.environ.get('HF_HOME') or '~/.cache/huggingface'}); run once with network, or analyze a "
            f"checkpoint file ({type(e).__name__})") from e


def _hub_offline(timeout: float = 3.0) -> str | None:
    """Why the Hugging Face Hub cannot be reached (HF_HUB_OFFLINE set, or no connection to it
    within ``timeout`` seconds), or None. Checked before a pretrained download, which otherwise
    retries for most of a minute before failing."""
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # only the proxy knows; let the download try
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return f"no network: {host}:{port} unreachable ({e.strerror or type(e).__name__})"
    return None


def _streamed(spec: str) -> bool:
    """Whether ``analyze`` reads ``spec`` tensor by tensor: a .safetensors file, or a directory
    holding a safetensors checkpoint (a Hugging Face model directory)."""
    path = Path(spec)
    if path.is_file():
        return path.suffix == ".safetensors"
    return path.is_dir() and any(path.glob("*.safetensors"))


def _with_small_matrices(args: argparse.Namespace, df, kinds: dict[str, str], model):
    """(table, kinds) with the SNR of the matrices --min-evals left out of the table too: Spectrum's
    ranking needs no fit, and SpectrumSelect ranks every matrix (a YAML without them froze them)."""
    if args.min_evals <= 1:
        return df, kinds
    import warnings

    import pandas as pd

    from lalr_lightning.core.spectral import htsr

    source = args.model if model is None else model  # None: streamed from the checkpoint
    with warnings.catch_warnings():  # "skips ... with more than max_evals": the table's own layers
        warnings.simplefilter("ignore", UserWarning)
        small, _ = htsr._analyze(source, metrics=["snr"], min_evals=1, max_evals=args.min_evals - 1,
                                 device=args.device, progress=False)
    small = small[~small["name"].isin(df["name"])]
    if small.empty:
        return df, kinds
    return (pd.concat([df[["name", "snr"]], small[["name", "snr"]]], ignore_index=True),
            {**kinds, **dict(zip(small["name"], small["kind"]))})


def _spectrum_yaml(df, kinds: dict[str, str], head: str | None, top_percent: float) -> tuple[str, int]:
    """Spectrum's YAML from an analyze table: the head and the embeddings always, then the top
    ``top_percent`` % by SNR of each module type (:mod:`lalr_lightning.core.spectral.spectrum_snr`)."""
    import math

    from lalr_lightning.core.spectral.spectrum_snr import top_by_type, unfrozen_yaml

    always = [n for n in df["name"] if n == head or kinds.get(n) == "embedding"]
    snr = {n: float(v) for n, v in zip(df["name"], df["snr"]) if n not in always and not math.isnan(float(v))}
    chosen = top_by_type(snr, top_percent)
    return unfrozen_yaml(chosen, [f"{n}.weight" for n in always]), len(always) + sum(map(len, chosen.values()))


#: which alpha fit a report used, and how to read the numbers a callback would see
_FIT_NOTES = {
    "ks": "alpha fit: ks (WeightWatcher's xmin, the KS-distance minimum). TempBalanceCallback fits 'median' by "
          "default, which gives other alphas: --fit median shows its reading",
    "median": "alpha fit: median (TempBalanceCallback's default, xmin at the median eigenvalue). WeightWatcher's "
              "fit: --fit ks",
    "peak": "alpha fit: peak (TempBalance's xmin_peak). TempBalanceCallback's default: --fit median; "
            "WeightWatcher's: --fit ks",
}


def _analyze_parser() -> argparse.ArgumentParser:
    from lalr_lightning.choices import FITS, PRESETS

    p = argparse.ArgumentParser(
        prog=f"{_prog()} analyze",
        description="Per-layer HT-SR spectral report (CSV + ESD plots) of a model.",
    )
    p.add_argument("model", help="timm model name, Lightning .ckpt / state-dict file, .safetensors file, or Hugging "
                                 "Face model directory (safetensors: read one tensor at a time, never built)")
    p.add_argument("--fit", default="ks", choices=FITS, help="power-law fit (default: ks, as WeightWatcher)")
    p.add_argument("--out", default="spectral_report", help="output directory (default: ./spectral_report)")
    p.add_argument("--pretrained", action="store_true", help="timm names: load pretrained weights (needs the hub)")
    p.add_argument("--min-evals", type=int, default=10, help="skip layers with fewer eigenvalues (default 10)")
    p.add_argument("--float64", action="store_true", help="compute in float64")
    p.add_argument("--device", default=None, help="where the eigenvalues are computed (cpu, cuda, cuda:1; default: "
                                                  "the weights' device, cpu for a checkpoint)")
    p.add_argument("--no-plots", action="store_true", help="write the CSV only")
    p.add_argument("--spectrum", type=float, default=None, metavar="P",
                   help="also write Spectrum's YAML of unfrozen parameters: the head, the embeddings and the top P%% "
                        "of matrices by SNR of each module type (spectrum_<P>percent.yaml in --out)")
    p.add_argument("--pruning", type=float, default=None, metavar="S",
                   help="also write the per-layer ratios HTSRPruning(target_sparsity=S) gives these weights "
                        "(pruning_<preset>_<S>.csv in --out; the same as callback.plan(model)); a Hugging Face "
                        "directory or .safetensors file is then loaded whole")
    p.add_argument("--preset", default=None, choices=[p for p in PRESETS if p != "owl"],
                   help="with --pruning: HTSRPruning's preset (alphapruning: AlphaPruning's LLM recipe)")
    p.add_argument("--head", action="store_true",
                   help="with --pruning: prune the output layer too (HTSRPruning(head=True); left dense by default)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (none is drawn when stderr is not a terminal)")
    p.add_argument("--unsafe-load", action="store_true",
                   help="read torch files that hold Python objects besides tensors (torch.load weights_only=False); "
                        "this runs code named in the file: only for files you trust")
    return p


def _analyze_args_error(args: argparse.Namespace) -> str | None:
    """The one-line error for arguments that need no file (checked before the work), or None."""
    if args.spectrum is not None and not 0 <= args.spectrum <= 100:
        return f"--spectrum takes a percentage in [0, 100], got {args.spectrum:g}"
    if args.head and args.pruning is None:
        return "--head goes with --pruning S (it prunes the output layer too): add --pruning S"
    if args.preset is not None and args.pruning is None:
        return f"--pruning takes a target sparsity in [0, 1), and --preset {args.preset} needs it: add --pruning S"
    if args.pruning is not None and not 0 <= args.pruning < 1:
        return f"--pruning takes a target sparsity in [0, 1), got {args.pruning}"
    if args.min_evals < 2:  # a power law is fitted to at least two eigenvalues, as the callbacks' min_evals
        return f"--min-evals must be at least 2 (a fit needs two eigenvalues), got {args.min_evals}"
    out = Path(args.out)
    if out.exists() and not out.is_dir():  # the work would end in FileExistsError
        return (f"--out {out} is an existing file; --out names a directory (created if missing) for "
                "spectral.csv and the plots: pass another path")
    return None


def _analyze_model(args: argparse.Namespace):
    """(table, ESDs, the model or None when streamed, layer kinds, the head's name) of ``args.model``."""
    import torch

    from lalr_lightning.core.spectral import htsr

    kw = dict(fit=args.fit, min_evals=args.min_evals, dtype=torch.float64 if args.float64 else torch.float32)
    if _streamed(args.model):  # every stored matrix, lm_head included, under the checkpoint's own names
        model = None
        df, esds = htsr._analyze(args.model, device=args.device, progress=False if args.quiet else None, **kw)
        kinds = dict(zip(df["name"], df["kind"]))
        head = "lm_head" if "lm_head" in kinds else next((n for n, k in kinds.items() if k == "embedding"), None)
    else:
        model = load_for_analysis(args.model, pretrained=args.pretrained, weights_only=not args.unsafe_load)
        df, esds = htsr._analyze(model, device=args.device, progress=False if args.quiet else None, **kw)
        from lalr_lightning.core.model.blocks import output_layer

        kinds = dict(zip(df["name"], df["kind"]))
        out_layer = output_layer(model)
        head = None if out_layer is None else out_layer.name
    return df, esds, model, kinds, head


def analyze_main(argv: list[str] | None = None) -> int:
    p = _analyze_parser()
    args = p.parse_args(argv)
    error = _analyze_args_error(args)
    if error is not None:
        print(f"{p.prog}: error: {error}", file=sys.stderr)
        return 2
    out = Path(args.out)
    created = not out.exists()
    try:  # before the work: an --out that cannot be made would lose it
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"{p.prog}: error: --out {out}: cannot create the directory ({e.strerror or type(e).__name__}); "
              "pass a writable path", file=sys.stderr)
        return 2
    from lalr_lightning import viz

    try:
        df, esds, model, kinds, head = _analyze_model(args)
    except (OSError, ValueError, ImportError, RuntimeError) as e:  # ValueError includes CheckpointFileError
        print(f"{p.prog}: error: {_first_line(e)}", file=sys.stderr)
        if created:  # nothing written: leave no empty folder behind
            with contextlib.suppress(OSError):
                out.rmdir()
        return 2
    csv = out / "spectral.csv"
    df.to_csv(csv, index=False)
    print(df[["name", "alpha", "xmin", "D", "num_evals", "spectral_norm", "stable_rank"]].to_string(index=False))
    print(f"\n{len(df)} layers -> {csv.resolve()}")
    print(_FIT_NOTES[args.fit])
    if args.spectrum is not None:
        ranked, ranked_kinds = _with_small_matrices(args, df, kinds, model)
        text, n = _spectrum_yaml(ranked, ranked_kinds, head, args.spectrum)
        target = out / f"spectrum_{args.spectrum:g}percent.yaml"
        target.write_text(text)
        print(f"Spectrum {args.spectrum:g}%: {n} of {len(ranked)} matrices unfrozen -> {target.resolve()}")
    if args.pruning is not None:
        from lalr_lightning.plans import write_pruning_plan

        try:
            whole = model if model is not None else load_for_analysis(args.model, weights_only=not args.unsafe_load)
            print(write_pruning_plan(whole, args.pruning, args.preset, out, head=args.head)[1])
        except (ValueError, RuntimeError) as e:  # the callback's argument names, as this command's flags
            said = _first_line(e).replace("set head=True", "pass --head")
            print(f"{p.prog}: error: {said}", file=sys.stderr)
            return 2
    if not args.no_plots:
        written = viz.save_esd_plots(model, df, out, esds=esds)
        print(f"plots -> {Path(written).resolve() if written else out.resolve()}")
    return 0
