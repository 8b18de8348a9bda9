"""Describe a Hugging Face causal LM built from its config on the meta device with
osdp_torch.describe, for the Rust tests to compare with `osdp-tui import-hf` of the same config.

usage: describe_hf.py CONFIG_DIR SEQ OUT.json [meta|cpu]
(cpu: the model built with real weights, described on fake tensors.)
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import osdp_torch  # noqa: E402


def main():
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dir, seq, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    cfg = AutoConfig.from_pretrained(config_dir)
    # Training keeps no KV cache (with one, transformers copies every block's keys and values).
    cfg.use_cache = False
    with torch.device(sys.argv[4] if len(sys.argv) > 4 else "meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    model.train()
    ids = torch.zeros(2, seq, dtype=torch.long)
    spec = osdp_torch.describe(model, {"input_ids": ids, "labels": ids}, name=cfg.model_type)
    with open(out, "w") as f:
        json.dump(spec, f, indent=1)


if __name__ == "__main__":
    main()
