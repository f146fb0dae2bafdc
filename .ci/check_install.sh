#!/usr/bin/env bash
# hydra-kernels installs and imports alone, pulling no other hydra package; installing hydra-diag
# from the built wheels brings the whole stack. torch/triton come from this machine's disk first so
# that the check measures our packages, not a multi-GB download.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q "torch==${HYDRA_CI_TORCH:-2.13.0}" "triton==${HYDRA_CI_TRITON:-3.6.0}"

"$py" -m pip install -q ./packages/hydra-kernels
others=$("$py" -m pip list --format=freeze | grep -E '^hydra-(model|train|diag)==' || true)
if [ -n "$others" ]; then
  echo "installing hydra-kernels pulled other hydra packages: $others" >&2
  exit 1
fi
"$py" -c "import hydra_kernels, sys; print('hydra_kernels', hydra_kernels.__version__, 'imports alone')"
"$work/venv/bin/hydra-kernels" --version

"$py" -m pip wheel -q --no-deps -w "$work/dist" ./packages/hydra-*
"$py" -m pip install -q --find-links "$work/dist" hydra-diag
for pkg in hydra-kernels hydra-model hydra-train hydra-diag; do
  "$py" -m pip show -q "$pkg" >/dev/null || { echo "$pkg missing after installing hydra-diag" >&2; exit 1; }
  "$work/venv/bin/$pkg" --version
done
# the dashboard's page and plotly.js must come with the wheels (no CDN at run time)
"$py" -c "from hydra_diag.dashboard.server import static_files as f; [p.read_bytes() for p, _ in f().values()]"
echo "standalone install check passed"
