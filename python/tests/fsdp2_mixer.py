"""A small MLP-mixer (no transformer in it): described by osdp_torch.describe, then, under an
osdp-tui FSDP2 export of a plan for that description, trained 5 steps in fp32 on gloo ranks
(CPU) and compared, loss by loss, with one process training the same global batch without FSDP.

usage: fsdp2_mixer.py describe OUT.json
       fsdp2_mixer.py train EXPORT.json
       fsdp2_mixer.py refuse EXPORT.json
`describe` writes the description; `train` prints `losses ok`, `shard bytes ok` and exits
non-zero naming the first step or rank that differs; `refuse` gives apply_plan three exports
that do not fit (a module path the mixer lacks, the export on a wider mixer, a split op) and
prints `refused <case>: <message>` for each.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import osdp_torch  # noqa: E402

import gloo_ranks  # noqa: E402  (beside this file)

STEPS = 5
PATCHES, PATCH_DIM, DIM, HIDDEN, DEPTH, CLASSES = 16, 12, 32, 64, 3, 10


class MixerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.token_mlp = nn.Sequential(nn.Linear(PATCHES, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, PATCHES))
        self.norm2 = nn.LayerNorm(DIM)
        self.channel_mlp = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))

    def forward(self, x):
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class Mixer(nn.Module):
    def __init__(self, width=None):
        super().__init__()
        self.stem = nn.Linear(PATCH_DIM, width or DIM)
        self.blocks = nn.Sequential(*[MixerBlock() for _ in range(DEPTH)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.stem(x))).mean(dim=1))


def build():
    torch.manual_seed(0)
    return Mixer()


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(n, PATCHES, PATCH_DIM, generator=g), torch.randint(0, CLASSES, (n,), generator=g))
        for _ in range(STEPS)
    ]


def reference(export):
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    out = []
    for x, y in batches(export["global_batch"]):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def rank_main(rank, world, export):
    model = osdp_torch.apply_plan(build(), export)
    parts = ((x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in batches(export["global_batch"]))
    return gloo_ranks.train_steps(
        model, export, world, parts, lambda m, p, micro: F.cross_entropy(m(p[0][micro]), p[1][micro])
    )


def train(export_path):
    export = osdp_torch.load_export(export_path)
    per_rank = gloo_ranks.run(export["world_size"], rank_main, export)
    gloo_ranks.check_training(per_rank, reference(export), export)


def refuse(export_path):
    """Each bad export raises PlanError, before any collective (no process group here)."""
    good = osdp_torch.load_export(export_path)
    missing = json.loads(json.dumps(good))
    missing["modules"][1]["path"] = "blocks.0.token_mlp.9"
    split = json.loads(json.dumps(good))
    linear = next(m for m in split["modules"] if m["path"] == "blocks.0.token_mlp.0")
    linear["sharding"] = "zero3/2:1"
    cases = [("missing", build(), missing), ("other", Mixer(width=48), good), ("split", build(), split)]
    for case, model, export in cases:
        try:
            osdp_torch.apply_plan(model, export)
            sys.exit(f"apply_plan took the {case} export")
        except osdp_torch.PlanError as e:
            print(f"refused {case}: {e}")


def main():
    if sys.argv[1] == "describe":
        x, y = batches(4)[0]
        spec = osdp_torch.describe(build(), (x,), name="mixer", loss_fn=lambda out: F.cross_entropy(out, y))
        with open(sys.argv[2], "w") as f:
            json.dump(spec, f, indent=1)
    elif sys.argv[1] == "refuse":
        refuse(sys.argv[2])
    else:
        train(sys.argv[2])


if __name__ == "__main__":
    main()
