#!/usr/bin/env bash
# The test command: installs libtorch into .venv on first use (see libtorch-env.sh), then runs
# every test with the trainer built in, and its test hooks (feature `fault-injection`: the
# crash tests set OSDP_FAULT). Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/libtorch-env.sh
# Tests that compare with Hugging Face transformers (its models, safetensors files) use this
# pinned version, installed into .venv once, beside torch.
transformers_version="5.24.0"
if ! python -c "import sys, transformers; sys.exit(transformers.__version__ != '$transformers_version')" 2>/dev/null; then
  echo "osdp-tui: installing transformers==$transformers_version into .venv (one time)" >&2
  python -m pip install --quiet --disable-pip-version-check \
    "transformers==$transformers_version" "torch==2.11.0"
fi
# osdp_torch (python/), the FSDP2 side of `export --to fsdp2`, editable, once; torch is above.
if ! python -c "import osdp_torch" 2>/dev/null; then
  python -m pip install --quiet --disable-pip-version-check --no-deps -e python
fi
export OSDP_TEST_PYTHON="$VIRTUAL_ENV/bin/python"
cargo test --workspace --features train,fault-injection "$@"
