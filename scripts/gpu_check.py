#!/usr/bin/env python3
"""The GPU check: run osdp-tui's trainer on this machine's GPU and print what docs/benchmarks.md
records. Run it through scripts/gpu-check.sh, which puts this machine's PyTorch libraries on the
library path first.

For each model (default gpt2-medium, gpt2-xl, tinyllama-1.1b), at world size 1 over NCCL:
  - the planner's plan for this GPU (layouts/h100-1x.json or h200-1x.json, the GPU's memory as
    the budget), then `osdp-tui train --device cuda` for --steps steps of random tokens;
  - tokens/s (median step after --warmup), MFU against the layout's dense bf16 peak, measured
    vs predicted step time and peak memory;
  - the same model in plain PyTorch eager (bf16 autocast, fp32 AdamW, SDPA attention) at the
    same micro-batch, and the ratio.
Then operator splitting on the largest Linear (split 1, 4, 8: step time and peak memory), and
the losses of the tiny model on the GPU (bf16) against the CPU reference run (fp32).

Everything lands in runs/gpu-check/ (JSON per measurement, summary.json, table.md).
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def sh(args, **kw):
    print("+", " ".join(str(a) for a in args), file=sys.stderr, flush=True)
    return subprocess.run([str(a) for a in args], check=True, **kw)


def read_steps(metrics):
    out = []
    for line in Path(metrics).read_text().splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        if ev.get("event") == "step":
            out.append(ev)
    return out


def layout_for_gpu():
    import torch

    name = torch.cuda.get_device_name(0)
    layout = "h200-1x" if "H200" in name else "h100-1x"
    return name, ROOT / "layouts" / f"{layout}.json"


def plan(bin_, model, layout, budget, out, pins=()):
    args = [bin_, "plan", model, "--layout", layout, "--budget", budget, "--json", "-o", out]
    for p in pins:
        args += ["--pin", p]
    res = sh(args, capture_output=True, text=True)
    return json.loads(res.stdout)


def train(bin_, model, plan_file, steps, metrics):
    sh([bin_, "train", model, "--plan", plan_file, "--device", "cuda", "--data", "random",
        "--steps", steps, "--metrics", metrics])
    return read_steps(metrics)


def summarise(steps, warmup):
    timed = steps[warmup:] or steps
    step_s = statistics.median(s["step_time_s"] for s in timed)
    peak = max(max(s["memory_bytes"]) for s in steps)
    return step_s, peak


# ---- the PyTorch eager reference: the same shapes, written the usual way ----

def eager_model(cfg):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    h, heads, kvh, hd = cfg["hidden"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    rms = cfg["norm"] == "rms_norm"
    gated = cfg["gated_mlp"]
    rotary = cfg["positional"] == "rotary"
    bias = cfg.get("bias", {})

    def norm():
        return nn.RMSNorm(h, eps=cfg["norm_eps"]) if rms else nn.LayerNorm(h, eps=cfg["norm_eps"])

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = norm(), norm()
            self.qkv = nn.Linear(h, (heads + 2 * kvh) * hd, bias=bias.get("qkv", False))
            self.o = nn.Linear(heads * hd, h, bias=bias.get("attn_out", False))
            width = cfg["ffn_hidden"]
            self.up = nn.Linear(h, width * (2 if gated else 1), bias=bias.get("mlp", False))
            self.down = nn.Linear(width, h, bias=bias.get("mlp", False))

        def forward(self, x, cos, sin):
            b, s, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).split([heads * hd, kvh * hd, kvh * hd], -1)
            q = q.view(b, s, heads, hd).transpose(1, 2)
            k = k.view(b, s, kvh, hd).transpose(1, 2)
            v = v.view(b, s, kvh, hd).transpose(1, 2)
            if rotary:
                def rot(t):
                    t1, t2 = t.chunk(2, -1)
                    return t * cos + torch.cat([-t2, t1], -1) * sin
                q, k = rot(q), rot(k)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kvh != heads)
            x = x + self.o(a.transpose(1, 2).reshape(b, s, heads * hd))
            u = self.up(self.n2(x))
            if gated:
                g, u = u.chunk(2, -1)
                u = F.silu(g) * u
            else:
                u = F.gelu(u, approximate="tanh")
            return x + self.down(u)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(cfg["vocab_size"], h)
            self.pos = None if rotary else nn.Embedding(cfg["max_positions"], h)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg["layers"]))
            self.nf = norm()
            self.head = nn.Linear(h, cfg["vocab_size"], bias=False)
            if cfg.get("tied_embeddings"):
                self.head.weight = self.emb.weight
            theta = cfg.get("rope_theta") or 10000.0
            inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
            ang = torch.outer(torch.arange(cfg["seq_len"]).float(), inv)
            self.register_buffer("cos", torch.cat([ang, ang], -1).cos(), persistent=False)
            self.register_buffer("sin", torch.cat([ang, ang], -1).sin(), persistent=False)

        def forward(self, ids):
            x = self.emb(ids)
            if self.pos is not None:
                x = x + self.pos(torch.arange(ids.shape[1], device=ids.device))
            for blk in self.blocks:
                x = blk(x, self.cos, self.sin)
            return self.head(self.nf(x))

    return Model()


def eager(model_json, batch, steps, warmup):
    import torch
    import torch.nn.functional as F

    cfg = json.loads(Path(model_json).read_text())["config"]
    torch.manual_seed(0)
    model = eager_model(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    seq, vocab = cfg["seq_len"], cfg["vocab_size"]
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq + 1), device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated()
    del model, opt
    torch.cuda.empty_cache()
    return statistics.median(times[warmup:] or times), peak


def model_flops_per_sample(model_json):
    ops = json.loads(Path(model_json).read_text())["ops"]
    return 3 * sum(o.get("fwd_flops_per_sample", 0) for o in ops)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=str(ROOT / "target/release/osdp-tui"))
    ap.add_argument("--models", default="gpt2-medium,gpt2-xl,tinyllama-1.1b")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "runs/gpu-check"))
    ap.add_argument("--skip-eager", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu, layout = layout_for_gpu()
    peak_bf16 = json.loads(layout.read_text())["device"]["dense_tflops"]["bf16"]["value"] * 1e12
    import torch

    budget = f"{torch.cuda.get_device_properties(0).total_memory // 2**20}MiB"
    rows = []
    for name in args.models.split(","):
        model = ROOT / "sample-models" / f"{name}.json"
        p = plan(args.bin, model, layout, budget, out / f"{name}.plan.json")
        steps = train(args.bin, model, out / f"{name}.plan.json", args.steps, out / f"{name}.jsonl")
        seq = json.loads(model.read_text())["config"]["seq_len"]
        step_s, peak = summarise(steps, args.warmup)
        batch = p["batch_size"]
        tokens = batch * seq / step_s
        mfu = model_flops_per_sample(model) * batch / step_s / peak_bf16
        row = {
            "model": name, "gpu": gpu, "batch": batch, "tokens_per_s": tokens, "mfu": mfu,
            "step_s": step_s, "predicted_step_s": p["step_time_s"],
            "peak_bytes": peak,
            "predicted_peak_bytes": p["peak_memory_bytes"] - p["prediction"]["overhead_bytes"],
        }
        if not args.skip_eager:
            e_step, e_peak = eager(model, batch, args.steps, args.warmup)
            row.update(eager_tokens_per_s=batch * seq / e_step, eager_peak_bytes=e_peak)
        rows.append(row)
        (out / f"{name}.json").write_text(json.dumps(row, indent=2))

    # Operator splitting on the largest Linear of the first model.
    name = args.models.split(",")[0]
    model = ROOT / "sample-models" / f"{name}.json"
    ops = json.loads(model.read_text())["ops"]
    linear = max((o for o in ops if o["kind"] == "linear" and o["params"]),
                 key=lambda o: math.prod(o["params"][0]["shape"]))
    split_rows = []
    for k in (1, 4, 8):
        f = out / f"{name}.split{k}.plan.json"
        p = plan(args.bin, model, layout, budget, f, pins=[f"{linear['id']}=zero3/{k}:{k}"])
        steps = train(args.bin, model, f, args.steps, out / f"{name}.split{k}.jsonl")
        step_s, peak = summarise(steps, args.warmup)
        split_rows.append({"split": k, "op": linear["id"], "batch": p["batch_size"],
                           "step_s": step_s, "peak_bytes": peak})

    # Losses: the tiny model on the GPU (bf16) against the CPU (fp32), same seed and data.
    tiny = ROOT / "sample-models/tiny-gpt2.json"
    tp = out / "tiny.plan.json"
    sh([args.bin, "plan", tiny, "--layout", ROOT / "layouts/cpu.json", "--budget", "1GiB",
        "--batch", "8", "-o", tp], capture_output=True)
    sh([args.bin, "train", tiny, "--plan", tp, "--steps", 30, "--metrics", out / "tiny.cpu.jsonl"])
    sh([args.bin, "train", tiny, "--plan", tp, "--steps", 30, "--device", "cuda",
        "--metrics", out / "tiny.cuda.jsonl"])
    cpu = [s["loss"] for s in read_steps(out / "tiny.cpu.jsonl")]
    gpu_l = [s["loss"] for s in read_steps(out / "tiny.cuda.jsonl")]
    worst = max(abs(a - b) / abs(a) for a, b in zip(cpu, gpu_l))

    summary = {"gpu": gpu, "layout": layout.name, "date": time.strftime("%Y-%m-%d"),
               "models": rows, "split": split_rows, "tiny_loss_max_rel_diff": worst}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    gib = 2**30
    lines = [f"GPU: {gpu} · layout {layout.name} · {summary['date']} · {args.steps} steps, "
             f"median after {args.warmup}", "",
             "| model | batch | tokens/s | MFU | eager tokens/s | ratio | step meas/pred | "
             "peak meas/pred |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        et = r.get("eager_tokens_per_s")
        eager_s = f"{et:.0f}" if et else "-"
        ratio = f"{r['tokens_per_s'] / et:.2f}" if et else "-"
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['tokens_per_s']:.0f} | {100 * r['mfu']:.1f} % | "
            f"{eager_s} | {ratio} | "
            f"{r['step_s'] * 1e3:.0f}/{r['predicted_step_s'] * 1e3:.0f} ms | "
            f"{r['peak_bytes'] / gib:.1f}/{r['predicted_peak_bytes'] / gib:.1f} GiB |")
    lines += ["", f"Splitting {split_rows[0]['op']} of {name}:", "",
              "| split | step | peak |", "|---|---|---|"]
    for s in split_rows:
        lines.append(f"| {s['split']} | {s['step_s'] * 1e3:.1f} ms | {s['peak_bytes'] / gib:.2f} GiB |")
    lines += ["", f"tiny-gpt2, 30 steps: GPU bf16 vs CPU fp32 losses differ by at most "
              f"{100 * worst:.2f} %"]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
