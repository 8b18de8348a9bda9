"""Train a Hugging Face model with an osdp-tui plan, in your own loop, with PyTorch FSDP2.

    torchrun --nproc-per-node 2 examples/fsdp2/train.py --config config.json --export export.json

The export (`osdp-tui export MODEL.json --plan PLAN.json --layout L --to fsdp2 -o export.json`)
says how each module is sharded; this script builds the model from its config, applies the
export with `osdp_torch.apply_plan`, and runs the export's micro-batch and gradient
accumulation on random tokens (replace `batches` with your data), printing loss and tokens/s.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import osdp_torch  # noqa: E402  (or `pip install -e python`)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="Hugging Face config.json")
    ap.add_argument("--export", required=True, help="osdp-tui export --to fsdp2 output")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-4)
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda" if cuda else "cpu")

    from transformers import AutoConfig, AutoModelForCausalLM

    export = osdp_torch.load_export(args.export)
    config = AutoConfig.from_pretrained(args.config)
    # Training keeps no KV cache (with one, transformers copies every block's keys and values).
    config.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    try:
        model = osdp_torch.apply_plan(model, export)
    except osdp_torch.PlanError as e:
        sys.exit(f"rank {rank}: {e}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)

    micro, acc = export["micro_batch"], export["accumulation"]
    seq = getattr(config, "n_positions", None) or config.max_position_embeddings
    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        start = time.perf_counter()
        total = torch.zeros((), device=device)
        for k in range(acc):
            # Gradients are reduced once, on the last micro-batch of the step.
            model.set_requires_gradient_sync(k == acc - 1)
            ids = torch.randint(0, config.vocab_size, (micro, seq), generator=g).to(device)
            loss = model(input_ids=ids, labels=ids).loss / acc
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        elapsed = time.perf_counter() - start
        if rank == 0:
            tokens = micro * acc * world * seq
            print(f"step {step}: loss {total.item() / world:.4f}, {tokens / elapsed:,.0f} tokens/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
