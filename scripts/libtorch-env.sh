#!/usr/bin/env bash
# Source this file (`. scripts/libtorch-env.sh`) to build or run with `--features train`.
#
# It installs PyTorch 2.11.0 (the libtorch that `tch` 0.24 is built against) into the
# project's own virtual environment `.venv` the first time, then exports what the `tch`
# build needs: the venv's python on PATH and LIBTORCH_USE_PYTORCH=1. A venv elsewhere can
# be named with OSDP_VENV. The wheel is ~4.6 GB; the install takes a minute or two.
_osdp_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_osdp_venv="${OSDP_VENV:-$_osdp_root/.venv}"
_osdp_torch="2.11.0"
if ! "$_osdp_venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$_osdp_torch')" 2>/dev/null; then
  echo "osdp-tui: installing torch==$_osdp_torch into $_osdp_venv (one time, ~4.6 GB)" >&2
  python3 -m venv "$_osdp_venv" || return 1 2>/dev/null || exit 1
  "$_osdp_venv/bin/python" -m pip install --quiet --disable-pip-version-check "torch==$_osdp_torch" \
    || return 1 2>/dev/null || exit 1
fi
export VIRTUAL_ENV="$_osdp_venv"
export PATH="$_osdp_venv/bin:$PATH"
export LIBTORCH_USE_PYTORCH=1
TORCH_LIB_DIR="$("$_osdp_venv/bin/python" -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"
export TORCH_LIB_DIR
unset _osdp_root _osdp_venv _osdp_torch
