"""Spectrum (Hartford et al. 2024, ``cognitivecomputations/spectrum``): train the matrices with the
highest signal-to-noise ratio of each module type, freeze the rest. The pure part: module types,
the per-type top-p% choice, and Spectrum's YAML of unfrozen parameter patterns.

Conventions taken from Spectrum's ``spectrum.py``:

* a matrix's type is its name after the first all-digit component (``model.layers.3.self_attn.q_proj``
  -> ``self_attn.q_proj``), or the whole name when it has none (``lm_head``,
  ``model.embed_tokens``); ``types`` maps name suffixes to types of your own choosing instead;
* within a type, the ``int(n * top_percent / 100)`` matrices of highest SNR are chosen (floor, as
  Spectrum: a type of one matrix is chosen only at 100%);
* the YAML lists ``unfrozen_parameters``: first the anchored patterns of the parameters always
  trained (Spectrum: ``^lm_head.weight$`` and ``^model.embed_tokens.weight$``), then, under a
  ``# <type> layers`` comment per type, the chosen module names by decreasing SNR. Tools that read
  it (axolotl) treat each line as a regular expression matched against parameter names.

One addition (:func:`group_types`, ``grouping="auto"``, the default of ``SpectrumSelect``): on names
without repeated structure Spectrum's rule gives every matrix a type of its own (``trunk.0``,
``trunk.2``, ``fc1``, ``layer1.conv``), and a type of one matrix trains only at 100 %, so the
matrices it would leave alone in their type are pooled by kind instead (``linear``, ``conv2d``, ...);
transformer names keep Spectrum's types (their types hold one matrix per block).
``grouping="spectrum"`` is Spectrum's rule alone, as ``analyze --spectrum`` uses.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from lalr_lightning.choices import unknown
from lalr_lightning.core.model.layers import Layer
from lalr_lightning.core.runtime.checks import lora_zero
from lalr_lightning.core.spectral import htsr

__all__ = ["GROUPINGS", "module_type", "group_types", "types_of", "top_by_type", "chosen_count", "grouping_report",
           "snr_of", "always_trained", "ranked_types",
           "unfrozen_yaml",
           "read_unfrozen_yaml"]

#: ``group_types`` rules: ``auto`` (Spectrum's types, lone matrices pooled by kind) or ``spectrum``
GROUPINGS = ("auto", "spectrum")


def module_type(name: str, types: Mapping[str, str] | None = None) -> str:
    """The module type of a matrix called ``name``: the type of the longest suffix of ``types``
    the name ends with (at a ``.`` boundary), else Spectrum's rule (module docstring)."""
    hit = _user_suffix(name, types)
    if hit is not None:
        return types[hit]
    parts = name.split(".")
    i = next((k for k, p in enumerate(parts) if p.isdigit()), None)
    return name if i is None or i == len(parts) - 1 else ".".join(parts[i + 1:])


def _user_suffix(name: str, types: Mapping[str, str] | None) -> str | None:
    hits = [s for s in (types or ()) if name == s or name.endswith("." + s)]
    return max(hits, key=len) if hits else None


def group_types(names: Iterable[str], kinds: Mapping[str, str] | None = None,
                types: Mapping[str, str] | None = None, grouping: str = "auto") -> dict[str, str]:
    """``{name: type}`` of the matrices ``names``. ``spectrum``: :func:`module_type`. ``auto``:
    the same, except that a matrix alone in its type (which no ``top_percent`` below 100 would
    choose) and not typed by ``types`` joins the other such matrices of its kind (``kinds[name]``,
    e.g. ``linear``), in a type called ``"<kind> (pooled)"``."""
    if grouping not in GROUPINGS:
        raise unknown("grouping", grouping, GROUPINGS)
    names = list(names)
    out = {n: module_type(n, types) for n in names}
    if grouping == "auto":
        size = Counter(out.values())
        for n in names:
            if size[out[n]] == 1 and _user_suffix(n, types) is None:
                out[n] = f"{(kinds or {}).get(n, 'matrix')} (pooled)"
    return out


def types_of(names: Iterable[str], types: Mapping[str, str] | None = None) -> dict[str, list[str]]:
    """``{type: [names in the given order]}``."""
    out: dict[str, list[str]] = {}
    for n in names:
        out.setdefault(module_type(n, types), []).append(n)
    return out


def top_by_type(snr: Mapping[str, float], top_percent: float,
                types: Mapping[str, str] | None = None, groups: Mapping[str, str] | None = None) -> dict[str, list[str]]:
    """``{type: chosen names, highest SNR first}``: per type, the ``int(n * top_percent / 100)``
    matrices of highest SNR (ties: model order). The type of each name is ``groups[name]``
    (from :func:`group_types`) when given, else :func:`module_type`. NaN SNRs are an error."""
    if not 0 <= top_percent <= 100:
        raise ValueError(f"top_percent must be in [0, 100], got {top_percent}")
    bad = [k for k, v in snr.items() if not isinstance(v, (int, float)) or math.isnan(v)]
    if bad and lora_zero(bad):  # a peft model: no layer_types tells its adapters from the base layers
        raise ValueError(f"SNR is NaN for {bad[:5]}: peft LoRA's lora_B matrices start at zero; Spectrum chooses "
                         "which of the model's own matrices train, in place of LoRA: run SpectrumSelect on the model "
                         "without LoRA")
    if bad:
        raise ValueError(f"SNR is NaN for {bad[:5]} (all-zero weights?); leave them out with layer_types")
    if groups is None:
        by_type = types_of(snr, types)
    else:
        by_type = {}
        for n in snr:
            by_type.setdefault(groups[n], []).append(n)
    out = {}
    for t, names in by_type.items():
        ranked = sorted(names, key=lambda n: -snr[n])  # stable: ties keep model order
        out[t] = ranked[: chosen_count(len(names), top_percent)]
    return out


def chosen_count(n: int, top_percent: float) -> int:
    """How many of a type of ``n`` matrices train: Spectrum's floor, ``int(n * top_percent / 100)``."""
    return int(n * top_percent / 100)


def snr_of(layers: Sequence[Layer]) -> dict[str, float]:
    """``{name: SNR}`` of each layer's matrix (:func:`htsr.layer_fits`' ``snr``; a matrix with NaN is
    reported by :func:`top_by_type`)."""
    return {f.name: f.value("snr") for f in htsr.layer_fits(layers, metrics=["snr"], min_evals=1)}


def always_trained(layers: Sequence[Layer], output: Layer | None, head: bool, embeddings: bool) -> list[str]:
    """The names of the layers that train whatever their SNR: the ``output`` layer (with ``head``)
    and the input embeddings (with ``embeddings``), as Spectrum's YAML always unfreezes them."""
    return [la.name for la in layers if (head and output is not None and la.name == output.name)
            or (embeddings and la.kind == "embedding")]


def ranked_types(layers: Sequence[Layer], always: Sequence[str], types: Mapping[str, str] | None = None,
                 grouping: str = "auto") -> tuple[dict[str, str], dict[str, str]]:
    """(``{name: type}`` of the ranked layers, those not in ``always`` (:func:`group_types` on their
    names and kinds), ``{name: type}`` of every layer: its ranked type, else :func:`module_type`)."""
    ranked = [la for la in layers if la.name not in always]
    groups = group_types([la.name for la in ranked], {la.name: la.kind for la in ranked}, types, grouping)
    return groups, {la.name: groups.get(la.name) or module_type(la.name, types) for la in layers}


def grouping_report(who: str, groups: Mapping[str, str], top_percent: float,
                    always: Sequence[str]) -> tuple[str, str | None]:
    """(one line saying how the ranked matrices (``groups``: name -> type) are grouped and how many of
    each type train at ``top_percent``, a warning when some type gets none, else None)."""
    by_type: dict[str, list[str]] = {}
    for n, t in groups.items():
        by_type.setdefault(t, []).append(n)
    p = top_percent
    parts = [f"{t}: {chosen_count(len(ns), p)} of {len(ns)}" for t, ns in by_type.items()]
    pooled = [t for t in by_type if t.endswith(" (pooled)")]
    note = (f"; {', '.join(pooled)}: matrices without a repeated-block name (Spectrum's rule would give each "
            "its own type), pooled by kind") if pooled else ""
    summary = (f"{who}: {len(groups)} ranked matrices in {len(by_type)} type(s), trained at top_percent={p:g}: "
               + ", ".join(parts) + note + f"; always trained: {', '.join(always) or 'none'}")
    empty = {t: ns for t, ns in by_type.items() if chosen_count(len(ns), p) == 0}
    if p == 0 or not groups or not empty:
        return summary, None
    if len(empty) == len(by_type):
        return summary, (
            f"{who}(top_percent={p:g}) selects none of the {len(groups)} ranked matrices (int(n * {p:g} / 100) = 0 in "
            "every type: " + ", ".join(f"{t} has {len(ns)}" for t, ns in empty.items()) + "), so "
            + (f"only {', '.join(always)} trains" if always else "no matrix trains")
            + "; raise top_percent or group the matrices with types={name suffix: type}")
    return summary, (f"{who}(top_percent={p:g}) selects no matrix of type(s) "
                     + ", ".join(f"{t} ({', '.join(ns)})" for t, ns in empty.items())
                     + f": int(n * {p:g} / 100) = 0; they stay frozen. Raise top_percent or group them with "
                     "types={name suffix: type}")


def unfrozen_yaml(chosen: Mapping[str, Sequence[str]], always: Sequence[str] = ()) -> str:
    """Spectrum's YAML: ``always`` (parameter names, written as anchored patterns) then the chosen
    module names under a comment per type."""
    lines = ["unfrozen_parameters:"]
    lines += [f"- ^{p}$" for p in always]
    for t, names in chosen.items():
        lines.append(f"# {t} layers")
        lines += [f"- {n}" for n in names]
    return "\n".join(lines) + "\n"


def read_unfrozen_yaml(text: str) -> list[str]:
    """The patterns of a Spectrum YAML (``unfrozen_parameters``), in order."""
    import yaml

    data = yaml.safe_load(text) or {}
    pats = data.get("unfrozen_parameters")
    if not isinstance(pats, list) or not all(isinstance(p, str) for p in pats):
        raise ValueError("not a Spectrum YAML: expected a list of patterns under 'unfrozen_parameters'")
    return pats
