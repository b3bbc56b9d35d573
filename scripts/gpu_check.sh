#!/usr/bin/env bash
# The GPU checks in one run (a lent GPU machine; writes logs to $OUT or ./gpu_out):
# the GPU lane, the 2:4 speed-up, LALR's ResNet-18 epoch ratio and the per-step overhead on CUDA.
# Missing packages (jsonargparse) travel as wheels in .whl/ (see the device tool's README).
set -u
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" HF_HUB_OFFLINE=1 WANDB_MODE=offline MPLBACKEND=Agg PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, lightning, transformers; print('torch', torch.__version__, 'lightning', lightning.__version__, 'transformers', transformers.__version__)"
# the timeouts add up to 560 s, under the device tool's 600 s a call; what is still unmeasured goes first
timeout "${LANE_S:-200}" python3 -m pytest -m gpu tests/gpu -p no:cacheprovider -n 4 -rfEs 2>&1 | tee "$OUT/gpu_lane.log" | tail -30
timeout 120 python3 benchmarks/lalr_overhead.py --workloads resnet18 --accelerator gpu --image-n 50000 --epochs 2 --repeats 2 2>&1 | tee "$OUT/lalr_overhead.log"
timeout 180 python3 benchmarks/step_overhead.py --accelerator gpu --clock wall --steps 200 --repeats 2 2>&1 | tee "$OUT/step_overhead.log"
timeout 60 python3 benchmarks/sparse24.py 2>&1 | tee "$OUT/sparse24.log"
