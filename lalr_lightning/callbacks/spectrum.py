"""Spectrum selection (Hartford et al. 2024): in ``setup``, before the model is wrapped, the
matrices with the highest signal-to-noise ratio of each module type train and the others are
frozen (:mod:`lalr_lightning.core.spectral.spectrum_snr` for the rules; the SNR is :func:`htsr.analyze`'s
``snr``, Spectrum's formula). Also ``SurgicalLayerSelect(mode="spectrum")``;
``python -m lalr_lightning analyze MODEL --spectrum 25`` writes the same choice as Spectrum's YAML.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from lalr_lightning.callbacks.base import Decision
from lalr_lightning.callbacks.host import Host, say, warn
from lalr_lightning.callbacks.selection import LayerSelection, register_mode
from lalr_lightning.choices import unknown
from lalr_lightning.core.model.blocks import output_layer
from lalr_lightning.core.model.layers import MATRIX_KINDS, check_kinds, matrix_layers
from lalr_lightning.core.model.probe import forward_order
from lalr_lightning.core.runtime.checks import check_finite
from lalr_lightning.core.spectral import spectrum_snr

__all__ = ["SpectrumSelect"]


@dataclass(eq=False, repr=False)
class SpectrumSelect(LayerSelection):
    """Train the top ``top_percent`` % of matrices by SNR within each module type; freeze the rest.

    Example::

        >>> import lightning.pytorch as pl
        >>> from lalr_lightning.callbacks import SpectrumSelect
        >>> from lalr_lightning.data import DigitsDataModule
        >>> from lalr_lightning.models import SmallCNN
        >>> spectrum = SpectrumSelect(top_percent=50)
        >>> trainer = pl.Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=0, logger=False,
        ...                      enable_checkpointing=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, callbacks=[spectrum])
        >>> trainer.fit(SmallCNN(width=16, in_channels=1), DigitsDataModule(batch_size=32))
        >>> len(spectrum.selected) < len(spectrum.layers)  # trained matrices: the head + top SNR per type
        True
        >>> all(spectrum.scores[n] > 0 for n in spectrum.scores)  # SNR of every ranked matrix
        True

    Args:
        top_percent: per module type, ``int(n * top_percent / 100)`` matrices train (Spectrum's
            floor; its papers use 25 and 50).
        types: ``{name suffix: type}`` to group matrices your way (``{"q_proj": "attn",
            "k_proj": "attn"}``); matrices no suffix matches follow Spectrum's rule: the name after
            the first all-digit component (``model.layers.3.mlp.down_proj`` -> ``mlp.down_proj``),
            or the whole name.
        grouping: ``"auto"`` (default): Spectrum's rule, except that matrices it would leave
            alone in their type -- every matrix of a model without repeated blocks (``trunk.0``,
            ``trunk.2``, ``fc1``), which no ``top_percent`` below 100 would train -- are pooled
            by kind (type ``"linear (pooled)"``, ``"conv2d (pooled)"``);
            ``"spectrum"``: Spectrum's rule alone (:mod:`lalr_lightning.core.spectral.spectrum_snr`).
        head, embeddings: the output layer / the input embeddings always train (Spectrum's YAML
            always unfreezes ``lm_head`` and ``model.embed_tokens``); ``False``: ranked in their
            own type like any matrix.
        layer_types: matrix kinds considered (default: all, embeddings included).
        norm_eval, save_compute: as every selection callback: the choice is made in ``setup``,
            before the strategy wraps the model, and the frozen matrices get
            ``requires_grad=False`` there (no weight gradient, no DDP all-reduce, no optimizer
            state; given back at teardown). A resumed run takes the checkpoint's choice.
        name, strict_resume: as every callback of the package.

    Parameters that belong to no matrix (norms, a lone bias) are not touched and keep training;
    Spectrum's YAML, read by tools that freeze everything not listed, freezes them.
    Readable: ``selected`` (matrix names), ``scores`` (SNR per matrix), the type of each
    (``module_types``) and the grouping in one line (``grouping_summary``, also logged at
    setup). A warning says when a type gets no matrix selected or when only the always-trained
    matrices train. Logged at the decision: ``<prefix>/snr/<matrix>``,
    ``<prefix>/selected/<matrix>``.
    """

    traits = LayerSelection.traits.but(
        log_prefix="spectrum",
        esd_plots=True,
        score_key="snr",
        decides_from_weights=True,  # plan(model): the decision without a fit
        readable=LayerSelection.traits.readable + ("module_types", "grouping_summary"),
    )
    title = "Spectrum"

    top_percent: float = 50.0
    types: Mapping[str, str] | None = None
    grouping: str = "auto"
    head: bool = True
    embeddings: bool = True
    layer_types: Sequence[str] = MATRIX_KINDS
    norm_eval: str = "frozen"
    save_compute: bool = True

    def validate(self) -> None:
        super().validate()
        if isinstance(self.top_percent, bool) or not 0 <= float(self.top_percent) <= 100:
            raise ValueError(f"top_percent must be in [0, 100], got {self.top_percent!r}")
        self.top_percent = float(self.top_percent)
        self.types = None if self.types is None else {str(k): str(v) for k, v in dict(self.types).items()}
        if self.grouping not in spectrum_snr.GROUPINGS:
            raise unknown("grouping", self.grouping, spectrum_snr.GROUPINGS)
        self.head = bool(self.head)
        self.embeddings = bool(self.embeddings)
        self.layer_types = check_kinds(self.layer_types)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.module_types: dict[str, str] = {}
        self.grouping_summary = ""
        self._always: list[str] = []
        self._groups: dict[str, str] = {}

    def configure(self, host: Host, module: nn.Module) -> None:
        every = matrix_layers(module)
        self.layers = [la for la in every if la.kind in self.layer_types]
        if not self.layers:
            raise ValueError(f"SpectrumSelect found no matrices of kinds {self.layer_types} in "
                             f"{type(module).__name__}; widen layer_types")
        out = output_layer(module, every, forward_order(host, module, getattr(self, "loss_fn", None)))
        self._always = spectrum_snr.always_trained(self.layers, out, self.head, self.embeddings)
        self._groups, self.module_types = spectrum_snr.ranked_types(self.layers, self._always, self.types,
                                                                    self.grouping)
        self.grouping_summary, warning = spectrum_snr.grouping_report(type(self).__name__, self._groups,
                                                                      self.top_percent, self._always)
        say(self.grouping_summary)
        if warning is not None:
            warn(warning)

    def decide_in_setup(self, host: Host, module: nn.Module) -> Decision:
        """The SNR needs only the weights: decided before the strategy wraps the model, so the
        frozen matrices never get a gradient (nor, under DDP, an all-reduce)."""
        return self.decide_everywhere(host, self.measure(host, module))

    def measure(self, host: Host, module: nn.Module) -> dict[str, float]:
        """SNR of every ranked matrix (the always-trained ones need none), shared out among ranks."""
        ranked = [[la] for la in self.layers if la.name not in self._always]

        def snr(layers):
            check_finite(type(self).__name__, host, {la.name: la.weight for la in layers}, "the weights")
            return spectrum_snr.snr_of(layers)

        return self.measure_shards(host, module, ranked, snr) if ranked else {}

    def decide(self, snr: dict[str, float]) -> Decision:
        chosen = {n for names in spectrum_snr.top_by_type(snr, self.top_percent, self.types, self._groups).values()
                  for n in names}
        chosen |= set(self._always)
        return Decision(values={la.name: float(la.name in chosen) for la in self.layers}, scores=dict(snr))

    def plan_columns(self) -> dict[str, dict[str, str]]:
        return {"type": dict(self.module_types)}  # the module type each matrix is ranked in


register_mode("spectrum", SpectrumSelect)
