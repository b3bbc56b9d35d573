"""Where the GPU lane runs: ``LALR_GPU_LANE=cuda`` (default; skipped without CUDA) or ``cpu``
(the lane's own code on the CPU)."""

import os

LANE = os.environ.get("LALR_GPU_LANE", "cuda")
ON_CUDA = LANE == "cuda"
