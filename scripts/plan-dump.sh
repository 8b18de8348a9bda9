#!/usr/bin/env bash
# Writes `plan --json` for every shipped sample model on every shipped layout into OUTDIR, one
# file a pair, without the two timing fields (search_time_ms, search_cpu_ms): two dumps made by
# builds before and after a planner change are byte-identical (`diff -r`) exactly when the change
# plans nothing differently (nor says anything else where nothing fits: such a pair writes the
# error `plan` prints).
#
#   scripts/plan-dump.sh OUTDIR                      # the release build in target/release
#   OSDP_BIN=/tmp/osdp-before scripts/plan-dump.sh /tmp/before
#   diff -r /tmp/before /tmp/after && echo identical
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${OSDP_BIN:-$root/target/release/osdp-tui}"
out="${1:?usage: scripts/plan-dump.sh OUTDIR}"
if [ ! -x "$bin" ]; then
  echo "plan-dump: $bin is missing: cargo build --release" >&2
  exit 2
fi
mkdir -p "$out"
err="$(mktemp)"
trap 'rm -f "$err"' EXIT
n=0
for m in "$root"/sample-models/*.json; do
  for l in "$root"/layouts/*.json; do
    name="$(basename "$m" .json)__$(basename "$l" .json)"
    "$bin" plan "$m" --layout "$l" --json 2>"$err" | ERR="$err" python3 -c '
import json, os, sys
text = sys.stdin.read()
try:
    doc = json.loads(text)
except ValueError:
    print(open(os.environ["ERR"]).read(), end="")
    sys.exit()
def strip(x):
    if isinstance(x, dict):
        return {k: strip(v) for k, v in x.items() if k not in ("search_time_ms", "search_cpu_ms")}
    if isinstance(x, list):
        return [strip(v) for v in x]
    return x
print(json.dumps(strip(doc), indent=1, sort_keys=True))
' >"$out/$name.json" || true
    n=$((n + 1))
  done
done
echo "plan-dump: $n pairs in $out"
