#!/usr/bin/env bash
# The GPU check, on a machine with an NVIDIA GPU and PyTorch 2.11 (see docs/benchmarks.md).
#
#   here (any machine with the project's libtorch):
#     . scripts/libtorch-env.sh && cargo build --release --features cuda
#   there (the GPU machine, with this working tree and target/release/osdp-tui):
#     scripts/gpu-check.sh [--models gpt2-medium,gpt2-xl,tinyllama-1.1b] [--steps 20]
#
# The binary runs against that machine's own PyTorch libraries (and the NCCL beside them), so
# nothing of this machine's ~4.6 GB libtorch has to travel.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
torch_lib="$("$py" -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"
nccl_lib="$(dirname "$torch_lib")/../nvidia/nccl/lib"
export LD_LIBRARY_PATH="$torch_lib:$nccl_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
"$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU visible to PyTorch")'
exec "$py" scripts/gpu_check.py "$@"
