# Sourced by the other scripts: where things live and the environment the build needs.
# shellcheck shell=bash
VRAMGATE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export VRAMGATE_ROOT
# shellcheck source=versions.env
source "$VRAMGATE_ROOT/scripts/versions.env"
export VRAMGATE_VENV="${VRAMGATE_VENV:-$VRAMGATE_ROOT/.venv}"
# torch-sys finds libtorch through the venv's python (LIBTORCH_USE_PYTORCH), so that python
# must come first on PATH for every cargo invocation.
export PATH="$VRAMGATE_VENV/bin:$HOME/.cargo/bin:$PATH"
export LIBTORCH_USE_PYTORCH=1
unset LIBTORCH
export PYTHONNOUSERSITE=1
