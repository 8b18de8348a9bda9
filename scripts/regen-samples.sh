#!/usr/bin/env bash
# Regenerate every sample-models/NAME.json from the Hugging Face config beside it, as listed in
# sample-models/MANIFEST.tsv (name, config under sample-models/hf/, extra import-hf flags).
# The test suite checks that the committed samples equal what this produces.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --quiet --bin osdp-tui
bin=target/debug/osdp-tui
while IFS=$'\t' read -r name config flags; do
  case "$name" in ''|'#'*) continue ;; esac
  # shellcheck disable=SC2086 # flags are words by design
  "$bin" import-hf "sample-models/hf/$config" --name "$name" $flags -o "sample-models/$name.json"
done < sample-models/MANIFEST.tsv
