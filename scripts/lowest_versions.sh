#!/usr/bin/env bash
# The quick tests at the floors pyproject.toml declares: a fresh venv, the LOWEST version of each
# direct dependency that the ranges allow (each pinned to its ">=" floor; the dependencies of
# those stay at their newest allowed), the clone installed editable with [dev,text], then pytest.
#
#   scripts/lowest_versions.sh                 # the smoke tests (-m smoke), or the fallback files below
#   scripts/lowest_versions.sh tests/test_control.py -x -q   # any pytest selection
#
# Run it before each release (docs/compatibility.md). It does not fit CI's time: the install
# alone downloads ~3 GB (PyPI's Linux torch wheels are CUDA builds, with the nvidia-* wheels).
# Environment: LOWEST_VENV=DIR keeps the venv there (default: a temporary folder, removed after);
# PYTHON=python3.X picks the interpreter (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ -n "${LOWEST_VENV:-}" ]; then
    VENV="$LOWEST_VENV"
else
    TMP="$(mktemp -d)"
    trap 'rm -rf "$TMP"' EXIT
    VENV="$TMP/venv"
fi

echo "== venv $VENV ($("$PY" --version))"
"$PY" -m venv "$VENV"
# uv itself from PyPI, inside the venv; this machine's pip constraints/extra indexes do not apply to uv
"$VENV/bin/python" -m pip install -q --disable-pip-version-check uv
# every direct dependency held to its declared floor (">=X" -> "==X.*", the lowest release of it
# with --resolution lowest-direct: "pytest-xdist>=3" is 3.0.2, there is no 3.0.0), its own
# dependencies at their newest; uv's lowest-direct alone settled on lightning 2.5.2 and
# transformers 5.0.0 here, not on the floors, so they are held outright: a floor that cannot be
# installed with the others fails the resolution, which names it
FLOORS="$(dirname "$VENV")/floors.txt"
"$VENV/bin/python" - "$FLOORS" <<'PY'
import re, sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = project["dependencies"] + [r for extra in ("dev", "text") for r in project["optional-dependencies"][extra]]
pins = {}
for req in reqs:
    m = re.match(r"^([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*(.*)$", req)
    floor = re.search(r">=\s*([^,\s;]+)", m.group(3))
    if floor:
        pins[m.group(1).lower()] = floor.group(1)
open(sys.argv[1], "w").write("".join(f"{name}=={v}.*\n" for name, v in sorted(pins.items())))
PY
echo "== the floors, from pyproject.toml"; cat "$FLOORS"
"$VENV/bin/uv" pip install --python "$VENV/bin/python" --index-url https://pypi.org/simple --resolution lowest-direct \
    -c "$FLOORS" -e ".[dev,text]"

echo "== the floors installed"
"$VENV/bin/uv" pip freeze --python "$VENV/bin/python" \
    | grep -iE '^(torch|torchvision|lightning|transformers|peft|datasets|timm|torchmetrics|jsonargparse|scikit-learn|pandas|matplotlib|tensorboard|numpy|pytest)==' \
    || true

if [ $# -eq 0 ]; then
    if grep -q '"smoke' pyproject.toml; then
        set -- -m smoke
    else  # until the smoke marker exists: fast test files that reach torch, Lightning and transformers
        set -- tests/test_control.py tests/test_spectral.py tests/test_tempbalance.py tests/test_lm_families.py
    fi
fi
echo "== python -m pytest $*"

HF_HUB_OFFLINE=1 WANDB_MODE=offline MPLBACKEND=Agg PYTHONPATH="$(pwd)" "$VENV/bin/python" -m pytest -p no:cacheprovider "$@"
