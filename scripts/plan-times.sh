#!/usr/bin/env bash
# Plans every shipped sample model on every shipped layout with `plan --json` (the release build)
# and prints the best of 3 `search_time_ms` per pair as a markdown table (issue 36: every pair
# where a plan fits under 5 ms). A pair where nothing fits prints "—". Also prints, per pair,
# nothing else: the budget-change time is the planner bench's (`cargo bench --bench planner`).
#
#   scripts/plan-times.sh                 # every model × every layout
#   scripts/plan-times.sh gpt2 tinyllama-1.1b -- cpu h100-1x    # some models, some layouts
#   OSDP_BIN=path/to/osdp-tui scripts/plan-times.sh
#   PLAN_TIMES_RUNS=5 scripts/plan-times.sh   # best of 5
#   PLAN_TIMES_ARGS='--headroom 0' scripts/plan-times.sh   # extra plan flags
#   PLAN_TIMES_FIELD=search_cpu_ms scripts/plan-times.sh  # the search thread's CPU time instead
#                                                         # of wall time (a machine others share)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${OSDP_BIN:-$root/target/release/osdp-tui}"
runs="${PLAN_TIMES_RUNS:-3}"
field="${PLAN_TIMES_FIELD:-search_time_ms}"
read -r -a extra <<<"${PLAN_TIMES_ARGS:-}"
if [ ! -x "$bin" ]; then
  echo "plan-times: $bin is missing: cargo build --release" >&2
  exit 2
fi
models=()
layouts=()
seen_sep=0
for a in "$@"; do
  if [ "$a" = "--" ]; then seen_sep=1; continue; fi
  if [ "$seen_sep" = 0 ]; then models+=("$a"); else layouts+=("$a"); fi
done
if [ ${#models[@]} -eq 0 ]; then
  for f in "$root"/sample-models/*.json; do models+=("$(basename "$f" .json)"); done
fi
if [ ${#layouts[@]} -eq 0 ]; then
  for f in "$root"/layouts/*.json; do layouts+=("$(basename "$f" .json)"); done
fi

printf '| model |'
for l in "${layouts[@]}"; do printf ' %s |' "$l"; done
printf '\n|---|'
for _ in "${layouts[@]}"; do printf -- '---:|'; done
printf '\n'
fits=0 over=0 worst=0 worst_pair=""
for m in "${models[@]}"; do
  printf '| %s |' "$m"
  for l in "${layouts[@]}"; do
    best=""
    for _ in $(seq "$runs"); do
      if out="$("$bin" plan "$root/sample-models/$m.json" --layout "$root/layouts/$l.json" \
          --json "${extra[@]}" 2>/dev/null)"; then
        t="$(jq -r ".$field" <<<"$out")"
        best="$(awk -v a="$best" -v b="$t" 'BEGIN { if (a == "" || b + 0 < a + 0) print b; else print a }')"
      else
        best=""
        break
      fi
    done
    if [ -z "$best" ]; then
      printf ' — |'
    else
      fits=$((fits + 1))
      if awk -v t="$best" 'BEGIN { exit !(t >= 5) }'; then
        over=$((over + 1))
        printf ' **%.1f** |' "$best"
      else
        printf ' %.2f |' "$best"
      fi
      if awk -v t="$best" -v w="$worst" 'BEGIN { exit !(t > w) }'; then
        worst="$best" worst_pair="$m on $l"
      fi
    fi
  done
  printf '\n'
done
printf '\n%d pairs plan; %d of them take 5 ms or more (bold); the slowest: %s, %.1f ms (best of %d, ms of %s).\n' \
  "$fits" "$over" "$worst_pair" "$worst" "$runs" "$field"
