"""Speed of the spectral analysis against WeightWatcher and against the bare SVDs.

For each timm model (random init) it times, best of ``--repeats``:

* ``bare SVD``: ``torch.linalg.svdvals`` once per layer on the same matrices our ESD uses
  (conv: the ``kh*kw`` slices), in float32;
* ``Gram``: the cheapest accurate route to the same eigenvalues: each layer's smaller Gram
  matrix ``W^T W`` formed in float64 (one batched product over a conv's kernel slices) and
  ``torch.linalg.eigvalsh``: the floor any analysis pays (``analyze`` is measured against it);
* ``analyze``: ``htsr.analyze(model, fit="ks")`` with the default metrics (every WW column
  plus ``snr``; no ``rand_distance``), which includes the batched SVDs, the exact KS xmin search
  over all candidates, and the metrics;
* ``alphas``: ``htsr.alphas(model, fit="median")``, the callbacks' fast path;
* ``WW``: ``weightwatcher.WeightWatcher(model).analyze(plot=False, randomize=False)``, its default
  KS power-law fit and norm metrics (no plots, no randomized ESD, no vectors/MP fits), which runs
  its SVDs in float64 with SciPy on CPU.

Both wall-clock and process CPU seconds are reported: on a shared machine the CPU time is the
steadier number; the timed functions alternate within each round. Run it from the checkout's
root with this checkout first on the path::

    PYTHONPATH=. python benchmarks/spectral_speed.py --models resnet18 resnet50 --repeats 3 --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import time
import warnings

import torch

from lalr_lightning.core.model.layers import matrix_layers
from lalr_lightning.core.spectral import esd, htsr


def _timed(fns: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """Best wall and best CPU seconds of each function over ``repeats`` rounds (after one warm-up
    run each); the functions alternate within a round, so a busy spell on a shared machine does
    not fall on one of them only."""
    for fn in fns.values():
        fn()
    walls: dict[str, list[float]] = {k: [] for k in fns}
    cpus: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            w, c = time.perf_counter(), time.process_time()
            fn()
            walls[key].append(time.perf_counter() - w)
            cpus[key].append(time.process_time() - c)
    return {k: (min(walls[k]), min(cpus[k])) for k in fns}


def _bare_svd(layers, dtype):
    mats = [esd._slices(layer.weight, layer.kind)[0] for layer in layers]

    def run():
        with torch.no_grad():
            for m in mats:
                torch.linalg.svdvals(m.to(dtype))

    return run


def _bare_gram(layers):
    mats = [esd._slices(layer.weight, layer.kind)[0] for layer in layers]

    def run():
        with torch.no_grad():
            for m in mats:
                w = m.to(torch.float64)
                torch.linalg.eigvalsh(w.mT @ w)

    return run


def _import_ww():
    try:
        import weightwatcher as ww
    except ImportError:
        return None
    logging.getLogger("weightwatcher").setLevel(logging.ERROR)
    return ww


def _ww_runner(model, ww):
    if ww is None:
        return None

    def run():
        with warnings.catch_warnings(), contextlib.redirect_stdout(None):
            warnings.simplefilter("ignore")
            ww.WeightWatcher(model=model).analyze(plot=False, randomize=False)

    return run


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["resnet18", "resnet50", "vit_small_patch16_224"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch/BLAS threads (default: torch's default)")
    p.add_argument("--no-ww", action="store_true", help="skip WeightWatcher")
    p.add_argument("--float64", action="store_true", help="also time analyze in float64")
    args = p.parse_args(argv)

    import timm

    # import everything that loads a BLAS before limiting threads: threadpoolctl only limits the
    # libraries already loaded (SciPy's OpenBLAS comes with weightwatcher)
    ww = None if args.no_ww else _import_ww()
    limits = contextlib.nullcontext()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
        with contextlib.suppress(ImportError):
            from threadpoolctl import threadpool_limits

            limits = threadpool_limits(args.threads)
    rows = []
    with limits:
        for name in args.models:
            torch.manual_seed(0)
            model = timm.create_model(name, pretrained=False).eval()
            layers = matrix_layers(model)
            fns = {
                "bare32": _bare_svd(layers, torch.float32),
                "gram": _bare_gram(layers),
                "ours32": lambda: htsr.analyze(layers, fit="ks"),  # noqa: B023
                "alphas": lambda: htsr.alphas(layers, fit="median"),  # noqa: B023
            }
            if args.float64:
                fns["bare64"] = _bare_svd(layers, torch.float64)
                fns["ours64"] = lambda: htsr.analyze(layers, fit="ks", dtype=torch.float64)  # noqa: B023
            ww_run = _ww_runner(model, ww)
            if ww_run is not None:
                fns["ww"] = ww_run
            rows.append({"model": name, "layers": len(layers), **_timed(fns, args.repeats)})
            _print(rows[-1:], header=len(rows) == 1)
    print()
    print(f"threads: torch {torch.get_num_threads()}; best of {args.repeats}; seconds as wall / cpu; "
          f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


def _fmt(t):
    return f"{t[0]:6.2f}/{t[1]:6.2f}" if t else "      -      "


def _ratio(a, b):
    return f"{a[0] / b[0]:5.2f}/{a[1] / b[1]:5.2f}" if a and b else "     -     "


def _print(rows, header: bool) -> None:
    if header:
        print(f"{'model':24s} {'n':>3s}  {'bare SVD32':>13s}  {'Gram64+eigh':>13s}  {'analyze ks':>13s}  "
              f"{'alphas med':>13s}  {'WeightWatcher':>13s}  {'WW/ours':>11s}  {'ours/Gram':>11s}  {'ours/SVD32':>11s}")
    for r in rows:
        ww = _ratio(r["ww"], r["ours32"]) if "ww" in r else "     -     "
        print(f"{r['model']:24s} {r['layers']:3d}  {_fmt(r['bare32'])}  {_fmt(r['gram'])}  {_fmt(r['ours32'])}  "
              f"{_fmt(r['alphas'])}  {_fmt(r.get('ww'))}  {ww}  {_ratio(r['ours32'], r['gram'])}  "
              f"{_ratio(r['ours32'], r['bare32'])}", flush=True)
        if "ours64" in r:
            print(f"{'':24s} fp64: bare {_fmt(r['bare64'])}  analyze {_fmt(r['ours64'])}  "
                  f"ours64/WW {_ratio(r['ours64'], r.get('ww'))}", flush=True)


if __name__ == "__main__":
    main()
