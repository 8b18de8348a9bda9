#!/usr/bin/env bash
# The test command: installs libtorch into .venv on first use (see libtorch-env.sh), then runs
# every test with the trainer built in. Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/libtorch-env.sh
cargo test --workspace --features train "$@"
