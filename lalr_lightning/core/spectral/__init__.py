"""Methods from the weights' spectra: HT-SR analysis (ESDs, power-law fits, per-layer metrics), TempBalance's
multipliers, LALR's metrics and Spectrum's per-type SNR choice."""
