#!/usr/bin/env bash
# The GPU check: one command on a machine with an NVIDIA GPU, its driver and Python with
# torch==2.11.0 importable. No Rust toolchain and no network are needed there.
#
#   here (any machine with the project's libtorch):
#     . scripts/libtorch-env.sh && cargo build --release --features cuda
#     mkdir -p dist && for b in osdp-tui osdp-tui-trainer; do strip -o dist/$b target/release/$b; done
#   there (this working tree with dist/osdp-tui and dist/osdp-tui-trainer beside it):
#     scripts/gpu-check.sh [--models gpt2-medium,gpt2-xl,tinyllama-1.1b] [--steps 20] [--budget 56GiB]
#
# The binary runs against that machine's own PyTorch libraries and the NCCL beside them (found
# here from `python3 -c 'import torch'`), so nothing of the build machine's libtorch travels.
# Results: runs/gpu-check/table.md and summary.json, written even when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
say() { echo "[gpu-check] $*" >&2; }

bin="${OSDP_BIN:-}"
if [ -z "$bin" ]; then
  for candidate in dist/osdp-tui target/release/osdp-tui; do
    if [ -x "$candidate" ]; then bin="$candidate"; break; fi
  done
fi
if [ -z "$bin" ] || [ ! -x "$bin" ]; then
  say "no osdp-tui binary (looked for OSDP_BIN, dist/osdp-tui, target/release/osdp-tui); build one with"
  say "  . scripts/libtorch-env.sh && cargo build --release --features cuda && mkdir -p dist && for b in osdp-tui osdp-tui-trainer; do strip -o dist/\$b target/release/\$b; done"
  exit 2
fi
# osdp-tui hands train, calibrate and validate over to the trainer beside it, the one binary
# that links libtorch.
trainer="$(dirname "$bin")/osdp-tui-trainer"
if [ ! -x "$trainer" ]; then
  say "no $trainer beside $bin: osdp-tui runs training through it; strip and copy both binaries"
  exit 2
fi

if ! site="$("$py" -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null)"; then
  say "$py cannot import torch: install torch==2.11.0 (the libtorch osdp-tui is built against), or name another Python with PYTHON=..."
  exit 2
fi
torch_version="$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
case "$torch_version" in
  2.11.*) ;;
  *) say "warning: PyTorch $torch_version here; osdp-tui is built against 2.11.0 and may not load" ;;
esac
# libtorch, and the CUDA, cuDNN and NCCL libraries pip installs beside it.
lib_path="$site/torch/lib"
for d in "$site"/nvidia/*/lib; do
  [ -d "$d" ] && lib_path="$lib_path:$d"
done
export LD_LIBRARY_PATH="$lib_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [ -e "$site/nvidia/nccl/lib/libnccl.so.2" ]; then
  export OSDP_NCCL_LIB="${OSDP_NCCL_LIB:-$site/nvidia/nccl/lib/libnccl.so.2}"
fi
if ! version="$("$trainer" --version 2>&1)"; then
  say "$trainer does not start against PyTorch $torch_version in $site/torch/lib:"
  say "  $version"
  exit 2
fi
say "$version, PyTorch $torch_version from $site"
exec "$py" scripts/gpu_check.py --bin "$bin" --python "$py" "$@"
