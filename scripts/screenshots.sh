#!/usr/bin/env bash
# Real screenshots of the dashboard: run it in tmux, capture the pane with its colours (ANSI),
# turn that into HTML (aha) and photograph the page with headless Chromium. Writes PNGs and the
# plain-text captures to screenshots/.
#
# Needs Debian's tmux, aha, chromium and fonts-dejavu-core:
#   apt-get install -y tmux aha chromium fonts-dejavu-core
set -euo pipefail
cd "$(dirname "$0")/.."
for tool in tmux aha chromium; do
  command -v "$tool" >/dev/null || { echo "screenshots.sh needs $tool (apt-get install -y tmux aha chromium fonts-dejavu-core)" >&2; exit 2; }
done
. scripts/libtorch-env.sh
# With the trainer beside it, so the dashboard's `s` starts real runs.
cargo build --release --quiet --features train --bin osdp-tui --bin osdp-tui-trainer
bin=$PWD/target/release/osdp-tui
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"; tmux kill-session -t osdp-shot 2>/dev/null || true' EXIT

# name, columns, rows, keys to send after start (space-separated tmux key names; `wait:N`
# pauses N seconds, `kill-worker` kills the training worker from outside), command args
shoot() {
  local name=$1 cols=$2 rows=$3 keys=$4; shift 4
  tmux kill-session -t osdp-shot 2>/dev/null || true
  tmux new-session -d -s osdp-shot -x "$cols" -y "$rows" "$bin $*"
  sleep 3
  for k in $keys; do
    case "$k" in
      wait:*) sleep "${k#wait:}" ;;
      # Only this script's workers: their plan and checkpoints lie in its run directories. A
      # worker is osdp-tui exec'ing osdp-tui-trainer, which its command line then names.
      kill-worker) pkill -KILL -f "osdp-tui(-trainer)? train .*$tmp/" || true; sleep 0.5 ;;
      *) tmux send-keys -t osdp-shot -- "$k"; sleep 0.3 ;;
    esac
  done
  sleep 1
  tmux capture-pane -p -t osdp-shot > "screenshots/$name.txt"
  tmux capture-pane -e -p -t osdp-shot > "$tmp/$name.ansi"
  # Quit; a dashboard with a run asks first, and s stops the run with a checkpoint.
  tmux send-keys -t osdp-shot q; sleep 0.3; tmux send-keys -t osdp-shot s 2>/dev/null || true; sleep 1
  {
    echo '<html><head><meta charset="utf-8"><style>'
    echo 'body{margin:0;background:#1e1e1e;color:#ddd}'
    echo 'pre{margin:8px;font-family:"DejaVu Sans Mono",monospace;font-size:14px;line-height:1.15}'
    echo '</style></head><body>'
    echo '<pre>'
    aha --no-header --black < "$tmp/$name.ansi"
    echo '</pre></body></html>'
  } > "$tmp/$name.html"
  local width=$(( cols * 85 / 10 + 16 )) height=$(( rows * 161 / 10 + 16 ))
  chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --user-data-dir="$tmp/profile" --hide-scrollbars \
    --window-size="$width,$height" --screenshot="$PWD/screenshots/$name.png" \
    "file://$tmp/$name.html" >/dev/null 2>&1
  echo "screenshots/$name.png"
}

shoot gpt2-xl-a100-16GiB 160 48 "Down Down Down Down" \
  sample-models/gpt2-xl.json --layout layouts/a100-80gb-8x-nvlink.json --budget 16GiB
shoot gpt2-xl-a100-after-ten-minus 160 48 "- - - - - - - - - -" \
  sample-models/gpt2-xl.json --layout layouts/a100-80gb-8x-nvlink.json --budget 16GiB
# Enter on an operator: every choice it could have, priced with the rest of the plan kept.
shoot llama-2-13b-operator-choices 160 48 "Down Down Down Down Down Enter" \
  sample-models/llama-2-13b.json --layout layouts/h100-sxm-2x8-ib-ndr.json --budget 40GiB
shoot llama-2-13b-2x8-h100 160 48 "Down Down Down" \
  sample-models/llama-2-13b.json --layout layouts/h100-sxm-2x8-ib-ndr.json --budget 40GiB
shoot llama-2-13b-help-120x40 120 40 "?" \
  sample-models/llama-2-13b.json --layout layouts/h100-sxm-2x8-ib-ndr.json --budget 40GiB
# Offload: llama-2-7b does not fit one 80 GiB H100 without it (docs/offload.md).
shoot llama-2-7b-h100-offload 160 48 "Down" \
  sample-models/llama-2-7b.json --layout layouts/h100-1x.json

# Training from the dashboard: tiny GPT-2 on the CPU layout (2 ranks), micro-batch 4.
train_args() { echo "sample-models/tiny-gpt2.json --layout layouts/cpu.json --budget 380MiB --batch 4 --checkpoint-every 10 --run-dir $tmp/run-$1"; }
# shellcheck disable=SC2046 # word splitting of the arguments is intended
shoot tiny-gpt2-training-live 160 50 "s wait:20" $(train_args live)
# shellcheck disable=SC2046
shoot tiny-gpt2-replanned-before-restart 160 50 "s wait:12 - - wait:1" $(train_args replan)
# shellcheck disable=SC2046
shoot tiny-gpt2-restarted-under-new-plan 160 50 "s wait:12 - - r wait:12" $(train_args restart)
# shellcheck disable=SC2046
shoot tiny-gpt2-worker-killed 160 50 "s wait:12 kill-worker wait:2" $(train_args killed)
# At 80×24 the run has no room beside the plan: view 4 shows it whole.
# shellcheck disable=SC2046
shoot tiny-gpt2-80x24-training-view 80 24 "s wait:12 4" $(train_args small)
# c: the plan on screen against the running one, after the budget moved.
# shellcheck disable=SC2046
shoot tiny-gpt2-compare 160 50 "s wait:12 - - c" $(train_args compare)
