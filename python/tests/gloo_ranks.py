"""What the FSDP2 test drivers share: run a function on gloo ranks (CPU processes, one thread
each) and collect what each returns; check trained ranks against one process."""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put((rank, fn(rank, world, *args), None))
    except Exception as e:  # reported by the parent
        queue.put((rank, None, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def run(world, fn, *args):
    """`fn(rank, world, *args)` on `world` spawned processes joined in one gloo group (`fn` at
    a module's top level, so that it can be sent): what each returned, by rank. Exits naming
    the rank when one raised."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted((queue.get(timeout=300) for _ in procs), key=lambda r: r[0])
    for p in procs:
        p.join(60)
    for rank, _, err in results:
        if err:
            sys.exit(f"rank {rank}: {err}")
    return [value for _, value, _ in results]


def train_steps(model, export, world, parts, loss_of):
    """One rank's AdamW steps on a model `apply_plan` wrapped: per item of `parts` (this rank's
    share of one global batch), the export's micro-batches accumulated with gradients
    synchronised on the last only, as the example trains; `loss_of(model, part, micro)` is the
    loss of micro-batch `micro` (a slice) of `part`. Returns the step losses averaged over the
    ranks and the bytes of this rank's local parameter shards, as `check_training` takes them."""
    from osdp_torch.apply import local_param_bytes

    shard_bytes = local_param_bytes(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    micro, acc = export["micro_batch"], export["accumulation"]
    losses = []
    for part in parts:
        total = torch.zeros(())
        for k in range(acc):
            model.set_requires_gradient_sync(k == acc - 1)
            loss = loss_of(model, part, slice(k * micro, (k + 1) * micro)) / acc
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses, shard_bytes


def check_training(per_rank, want, export):
    """`per_rank`: each rank's (losses, bytes of its local parameter shards). Every loss within
    1e-5 relative of `want` (one process's) and the shards as the export predicts; prints
    `losses ok` and `shard bytes ok`, or exits naming the first rank and step that differ."""
    worst = 0.0
    for rank, (losses, shard_bytes) in enumerate(per_rank):
        for step, (a, b) in enumerate(zip(losses, want)):
            worst = max(worst, abs(a - b) / abs(b))
            if abs(a - b) > 1e-5 * abs(b):
                sys.exit(f"rank {rank} step {step}: loss {a!r}, one process {b!r}")
        if shard_bytes != export["predicted"]["param_bytes_per_rank"]:
            sys.exit(
                f"rank {rank}: local shards {shard_bytes} bytes, plan predicts "
                f"{export['predicted']['param_bytes_per_rank']}"
            )
    print("losses ok:", " ".join(f"{x:.6f}" for x in want), f"(largest relative difference {worst:.2e})")
    print("shard bytes ok:", per_rank[0][1])
