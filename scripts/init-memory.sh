#!/usr/bin/env bash
# Peak host memory of each rank while it loads a Hugging Face checkpoint (`--init-from`): a
# synthetic ~2 GB fp32 LLaMA-shaped checkpoint, four rank processes (as torchrun starts them)
# under an all-zero3 plan, one training step each, against the same run from seeded weights.
# Prints one line per run: each rank's peak resident memory (VmHWM, from GNU time's %M).
#
#   [HIDDEN=2048] scripts/init-memory.sh [WORK_DIR]   (the trainer build; ~20 GB of memory at 2048)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/libtorch-env.sh
work="${1:-$(mktemp -d)}"
mkdir -p "$work"
bin="${OSDP_BIN:-target/release/osdp-tui}"
[ -x "$bin" ] || bin=target/debug/osdp-tui
# HIDDEN=1536 makes a ~1.2 GiB checkpoint where memory is short.
hidden="${HIDDEN:-2048}"
[ -f "$work/ckpt/model.safetensors" ] || python - "$work/ckpt" "$hidden" <<'PY'
import sys, torch, transformers as tf
h = int(sys.argv[2])
cfg = tf.LlamaConfig(vocab_size=32000, hidden_size=h, intermediate_size=(h * 8 // 3 + 63) // 64 * 64,
                     num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
                     max_position_embeddings=64, tie_word_embeddings=False)
with torch.device("meta"):
    m = tf.AutoModelForCausalLM.from_config(cfg)
m = m.to_empty(device="cpu")
with torch.no_grad():
    for p in m.parameters():
        p.normal_(0, 0.02)
m.save_pretrained(sys.argv[1], max_shard_size="10GB")
n = sum(p.numel() for p in m.parameters())
big = max(p.numel() for p in m.parameters())
print(f"checkpoint: {n/1e6:.0f} M parameters, {4*n/2**30:.2f} GiB fp32, largest tensor {4*big/2**20:.0f} MiB", file=sys.stderr)
PY
"$bin" import-hf "$work/ckpt/config.json" --seq-len 64 -o "$work/m.json" >/dev/null
# Every op zero3: each rank holds a quarter of every parameter.
"$bin" plan "$work/m.json" --layout cpu --batch 1 --budget 64GiB -o "$work/p.json" \
  $(python -c "import json; print(' '.join('--pin %s=zero3' % o['id'] for o in json.load(open('$work/m.json'))['ops'] if o['params']))") >/dev/null
run() {
  local label="$1"; shift
  local port=$((20000 + RANDOM % 20000)) pids=() r
  for r in 0 1 2 3; do
    RANK=$r WORLD_SIZE=4 LOCAL_WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      OSDP_RUN_TOKEN=init-memory /usr/bin/time -f "%M" -o "$work/rss-$label-$r" \
      "$bin" train "$work/m.json" --plan "$work/p.json" --steps 1 --data random "$@" \
      >"$work/log-$label-$r" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  printf '%-12s peak resident per rank (MiB):' "$label"
  for r in 0 1 2 3; do printf ' %d' $(( $(cat "$work/rss-$label-$r") / 1024 )); done
  echo
}
# ONLY=init-from skips the seeded run (half the time and memory).
[ "${ONLY:-}" = init-from ] || run seeded
run init-from --init-from "$work/ckpt"
