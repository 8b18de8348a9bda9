"""Train a tiny random GPT-2 (or any causal LM config transformers knows, e.g. LLaMA) under an osdp-tui FSDP2 export on 2 gloo ranks (CPU), 5 steps in
fp32, and compare every loss with one process training the same global batch without FSDP.

usage: fsdp2_gpt2.py CONFIG.json EXPORT.json [BAD_EXPORT.json]
Prints `losses ok`, `shard bytes ok` and, with BAD_EXPORT, `refused: <message>`.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import osdp_torch  # noqa: E402

import gloo_ranks  # noqa: E402  (beside this file)

STEPS = 5


def config_of(config_path):
    from transformers import AutoConfig

    with open(config_path) as f:
        raw = json.load(f)
    return AutoConfig.for_model(raw.pop("model_type"), **raw)


def build(config_path, cfg=None):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg or config_of(config_path)).float()


def seq_of(model):
    return getattr(model.config, "n_positions", None) or model.config.max_position_embeddings


def batches(export, vocab, seq):
    g = torch.Generator().manual_seed(1)
    n = export["global_batch"]
    return [torch.randint(0, vocab, (n, seq), generator=g) for _ in range(STEPS)]


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


def reference(config_path, export):
    model = build(config_path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    out = []
    for ids in batches(export, model.config.vocab_size, seq_of(model)):
        loss = loss_of(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def rank_main(rank, world, config_path, export):
    model = osdp_torch.apply_plan(build(config_path), export)
    parts = (
        ids.view(world, -1, ids.shape[1])[rank]
        for ids in batches(export, model.config.vocab_size, seq_of(model))
    )
    return gloo_ranks.train_steps(
        model, export, world, parts, lambda m, part, micro: loss_of(m, part[micro])
    )


def main():
    config_path, export_path = sys.argv[1], sys.argv[2]
    export = osdp_torch.load_export(export_path)
    per_rank = gloo_ranks.run(export["world_size"], rank_main, config_path, export)
    gloo_ranks.check_training(per_rank, reference(config_path, export), export)
    if len(sys.argv) > 3:
        refusal(config_path, sys.argv[3])


def refusal(config_path, bad_path):
    """apply_plan on an export that does not fit: one clear error, before any collective.
    Refused twice: the bad export (a module path the model lacks) on this model, and the good
    export on a wider GPT-2 (another model)."""
    try:
        osdp_torch.apply_plan(build(config_path), bad_path)
        sys.exit("apply_plan took an export naming a module the model lacks")
    except osdp_torch.PlanError as e:
        print("refused:", e)
    cfg = config_of(config_path)
    cfg.hidden_size *= 2
    try:
        osdp_torch.apply_plan(build(config_path, cfg), sys.argv[2])
        sys.exit("apply_plan took an export made for another model")
    except osdp_torch.PlanError as e:
        print("refused other model:", e)


if __name__ == "__main__":
    main()
