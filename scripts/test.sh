#!/usr/bin/env bash
# The test command: installs libtorch into .venv on first use (see libtorch-env.sh), then runs
# every test with the trainer built in, and its test hooks (feature `fault-injection`: the
# crash tests set OSDP_FAULT). Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/libtorch-env.sh
cargo test --workspace --features train,fault-injection "$@"
