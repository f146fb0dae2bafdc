#!/usr/bin/env bash
# Source this on a GPU machine with no network, from the repository root:
#   source tools/gpu_env.sh
# It puts the four packages' sources on PYTHONPATH (no build step needed) and, when a .whl/ folder
# of peer wheels is present (Liger-Kernel, bitsandbytes, torchao: wheels downloaded on a machine with network),
# installs them into /tmp/site without touching the machine's own packages.
export PYTHONUNBUFFERED=1
root=$(pwd)
site=/tmp/site
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    || echo "gpu_env: installing the peer wheels failed; benchmarks will skip those peers" >&2
fi
export PYTHONPATH="$root/packages/hydra-kernels/src:$root/packages/hydra-model/src:$root/packages/hydra-train/src:$root/packages/hydra-diag/src:$site${PYTHONPATH:+:$PYTHONPATH}"
python3 - <<'PY'
import torch, triton
print(f"gpu_env: torch {torch.__version__}, triton {triton.__version__}, "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA'}")
PY
