"""Measure what FSDP2 holds on CPU while it trains a Hugging Face causal LM under an osdp-tui
export: 2 gloo ranks, 3 steps, `torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`
(which counts every tensor's storage, by kind: sharded and unsharded parameters, gradients,
optimizer state, activations, temporaries) around the second and third.

usage: fsdp2_memory.py CONFIG_DIR EXPORT.json
Prints one JSON line: rank 0's peak, in bytes, whole and by kind.
"""

import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import osdp_torch  # noqa: E402

STEPS = 3


def rank_main(rank, world, port, config_dir, export, queue):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from transformers import AutoConfig, AutoModelForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = AutoConfig.from_pretrained(config_dir)
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
        queue.put((rank, {str(getattr(k, "value", k)): v for k, v in peak.items()}, None))
    except Exception as e:  # reported by the parent
        queue.put((rank, None, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def main():
    config_dir, export_path = sys.argv[1], sys.argv[2]
    export = osdp_torch.load_export(export_path)
    world = export["world_size"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=rank_main, args=(r, world, port, config_dir, export, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    for rank, _, err in results:
        if err:
            sys.exit(f"rank {rank}: {err}")
    print(json.dumps(results[0][1]))


if __name__ == "__main__":
    main()
