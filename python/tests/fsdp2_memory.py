"""Measure what FSDP2 holds on CPU while it trains a Hugging Face causal LM under an osdp-tui
export: 2 gloo ranks, 3 steps, `torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`
(which counts every tensor's storage, by kind: sharded and unsharded parameters, gradients,
optimizer state, activations, temporaries) around the second and third.

usage: fsdp2_memory.py CONFIG_DIR EXPORT.json
Prints one JSON line: rank 0's peak, in bytes, whole and by kind.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import osdp_torch  # noqa: E402

import gloo_ranks  # noqa: E402  (beside this file)

STEPS = 3


def rank_main(rank, world, config_dir, export):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(config_dir)
    # Training keeps no KV cache (with one, transformers copies every block's keys and values).
    cfg.use_cache = False
    torch.manual_seed(0)
    model = osdp_torch.apply_plan(AutoModelForCausalLM.from_config(cfg).float(), export)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    micro, acc = export["micro_batch"], export["accumulation"]
    seq = getattr(cfg, "n_positions", None) or cfg.max_position_embeddings
    g = torch.Generator().manual_seed(rank)
    tracker = FSDPMemTracker(model, opt)
    with tracker:
        for step in range(STEPS):
            for k in range(acc):
                model.set_requires_gradient_sync(k == acc - 1)
                ids = torch.randint(0, cfg.vocab_size, (micro, seq), generator=g)
                (model(input_ids=ids, labels=ids).loss / acc).backward()
            opt.step()
            opt.zero_grad()
            if step == 0:
                # The first step allocates the optimizer's state: a steady step is measured.
                tracker.reset_mod_stats()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return {str(getattr(k, "value", k)): v for k, v in peak.items()}


def main():
    config_dir, export_path = sys.argv[1], sys.argv[2]
    export = osdp_torch.load_export(export_path)
    per_rank = gloo_ranks.run(export["world_size"], rank_main, config_dir, export)
    print(json.dumps(per_rank[0]))


if __name__ == "__main__":
    main()
