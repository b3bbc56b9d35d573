"""The spectral numbers of this checkout against another tree's, to the bit: HT-SR tables (every
metric, each fit), the alphas (with and without the zero filter), pruning's per-layer metrics,
TempBalance's fitted alphas, Spectrum's SNR, and the warnings they give, on a small model with an
all-zero layer (a failed fit) and a size filter (skipped layers).

Usage::

    python scripts/same_numbers.py --before /path/to/other/tree   # a folder holding lalr_lightning/

Prints ``N results, all equal`` or each result that differs; exit status 1 when one does.
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _measure(path: str) -> None:
    import warnings

    import torch
    from torch import nn

    from lalr_lightning.core.model.layers import matrix_layers
    from lalr_lightning.core.pruning import alphapruning as ap
    from lalr_lightning.core.spectral import htsr
    from lalr_lightning.core.spectral import tempbalance as tb
    from lalr_lightning.core.spectral.spectrum_snr import snr_of

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 48), nn.Linear(48, 48),
                          nn.Linear(48, 10))
    with torch.no_grad():
        model[4].weight.zero_()
    layers = matrix_layers(model)
    out: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for fit in ("median", "ks", "peak"):
            out[f"table {fit}"] = htsr.analyze(model, fit=fit, metrics="all", min_evals=2).to_dict("list")
            out[f"alphas {fit}"] = htsr.alphas(model, fit=fit)
            out[f"alphas filter_zeros {fit}"] = htsr.alphas(model, fit=fit, filter_zeros=True)
            for metric in ("alpha", "alpha_weighted", "log_alpha_norm", "stable_rank", "entropy", "snr",
                           "rand_distance"):
                values = ap.layer_metric(layers, metric, fit=fit, filter_zeros=False)
                out[f"pruning metric {fit} {metric}"] = {k: float(v) for k, v in values.items()}
        fitted = tb.fit_alphas(layers, "median", filter_zeros=False)  # (alpha, why) before LayerFit
        out["tempbalance alphas"] = {k: v[0] if isinstance(v, tuple) else v.alpha for k, v in fitted.items()}
        out["spectrum snr"] = snr_of(layers)
        out["table with skips"] = htsr.analyze(model, min_evals=20, max_evals=40).to_dict("list")
    out["warnings"] = [str(w.message) for w in caught]
    Path(path).write_bytes(pickle.dumps(out))


def _same(x, y) -> bool:
    if isinstance(x, float) and isinstance(y, float):
        return (math.isnan(x) and math.isnan(y)) or x == y
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return isinstance(y, (list, tuple)) and len(x) == len(y) and all(_same(p, q) for p, q in zip(x, y))
    return x == y


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a folder holding the other tree's lalr_lightning/")
    parser.add_argument("--_measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._measure:
        _measure(args._measure)
        return 0
    if not (Path(args.before) / "lalr_lightning" / "__init__.py").is_file():
        parser.error(f"--before {args.before}: no lalr_lightning/ there; give the root of a checkout")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for tree in (args.before, str(ROOT)):
            out = os.path.join(tmp, f"{len(results)}.pkl")
            env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
            subprocess.run([sys.executable, __file__, "--before", tree, "--_measure", out], env=env, check=True)
            results.append(pickle.loads(Path(out).read_bytes()))
    before, after = results
    differ = [k for k in before if k not in after or not _same(before[k], after[k])]
    for k in differ:
        print(f"differs: {k}\n  before: {before[k]}\n  after:  {after.get(k)}")
    print(f"{len(before)} results, " + ("all equal" if not differ else f"{len(differ)} differ"))
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
