#!/usr/bin/env bash
# The fast suite on the oldest transformers and huggingface_hub that pyproject.toml declares,
# in a venv of its own (a --system-site-packages venv would see the newer ones). CI runs the
# full suite on the newest releases first; this proves the other end of the declared range.
#   bash scripts/ci_floor.sh [pytest args]     (default: -q -m "not slow")
# FLOOR_VENV picks the venv's folder (default: $TMPDIR/msd-ci-floor, rebuilt on every run).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${FLOOR_VENV:-${TMPDIR:-/tmp}/msd-ci-floor}"
floors=$(python - <<'EOF'
import pathlib, re
text = pathlib.Path("pyproject.toml").read_text()
pins = [f"{name}=={version}" for name, version in re.findall(r'"(transformers|huggingface_hub)>=([0-9.]+)', text)]
assert len(pins) == 2, f"pyproject.toml should declare transformers>= and huggingface_hub>= floors, found {pins}"
print(" ".join(pins))
EOF
)
# The torch the outer environment installed (the same wheel, from pip's cache).
torch_pin="torch==$(python -c 'import torch; print(torch.__version__.split("+")[0])')"
echo "floor environment: $floors $torch_pin in $venv"
python -m venv --clear "$venv"
"$venv/bin/python" -m pip install --quiet "$torch_pin"
"$venv/bin/python" -m pip install --quiet -e ".[dev]" $floors
# pip may not silently hand us another version: check the pins took.
"$venv/bin/python" - $floors <<'EOF'
import sys
from importlib.metadata import version
from packaging.version import Version
for pin in sys.argv[1:]:
    name, want = pin.split("==")
    assert Version(version(name)) == Version(want), f"{name} {version(name)} installed, {want} wanted"
EOF
if [ $# -eq 0 ]; then set -- -q -m "not slow"; fi
"$venv/bin/python" -m pytest "$@"
