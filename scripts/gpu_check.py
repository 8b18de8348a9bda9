#!/usr/bin/env python3
"""The GPU check: run osdp-tui's trainer on this machine's GPU and record what docs/benchmarks.md
and docs/fidelity.md report. Run it through scripts/gpu-check.sh, which finds this machine's
PyTorch libraries and puts them on the library path first.

Steps, each on its own so that one failure does not lose the others' figures, each skipped
with a message when what is left of --deadline-s would not cover it:
  0. calibrate: `osdp-tui calibrate --device cuda --quick` writes this GPU's measured layout
     (efficiencies of the trainer's kernels); the models are planned on it and priced on the
     datasheet layout too.
  1. smoke: tiny-gpt2 and tiny-llama, --smoke-steps steps on the CPU (fp32) and on the GPU
     (bf16) with the same seed and data; the losses must agree to bf16 tolerance. If the GPU
     cannot train at all, the check stops here with the trainer's own message.
  2. per model (default gpt2-medium, gpt2-xl, tinyllama-1.1b), world size 1: the planner's plan
     for this GPU under --budget (default 70 % of the GPU's memory), `osdp-tui train --device
     cuda` for --steps steps of random tokens; tokens/s (median after --warmup), MFU against the
     layout's dense bf16 peak, measured vs predicted step time and peak memory (the executor's
     ledger, the CUDA allocator's reserved peak, NVML's figure for the process); then the same
     model in plain PyTorch eager (bf16 autocast, fused AdamW, SDPA) at the same micro-batch, in
     a child process, halving the batch on out-of-memory and saying which batch it used.
  3. operator splitting of the largest untied Linear of the first model (split 1, 4, 8).
  4. padding: the first model whose LM head the trainer pads (GPT-2's 50,257 rows) trained again
     with that padding off (OSDP_GEMM_PADDING=0).
  5. allocator: the model whose reserved peak rose most above its allocated peak trained again
     with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the trainer's default since
     2026-11-28, so both runs match unless the caller set the variable otherwise).
  6. the dashboard's `--once` frame of the last model on this GPU's layout, with NVML's live
     memory, saved as once.txt.

This process never initialises CUDA itself: every GPU user is a child process, so the runs have
the GPU to themselves. Everything lands in --out (default runs/gpu-check/): JSON per
measurement, summary.json and table.md, written after every step.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30


def log(msg):
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class StepFailed(Exception):
    """A command of the check failed; the message is its own last words."""


def run(args, **kw):
    args = [str(a) for a in args]
    log("+ " + " ".join(args))
    res = subprocess.run(args, capture_output=True, text=True, **kw)
    if res.returncode != 0:
        last = (res.stderr.strip() or res.stdout.strip() or f"exit {res.returncode}").splitlines()
        raise StepFailed(f"{Path(args[0]).name} {args[1]}: exit {res.returncode}: {last[-1]}")
    # A fused kernel that failed and fell back says so once: worth seeing in the check's log.
    for line in (res.stderr or "").splitlines():
        if line.startswith("warning:"):
            log(f"{Path(args[0]).name} {args[1]}: {line}")
    return res


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


# ---- the GPU, asked in a child so this process never holds a CUDA context ----

GPU_QUERY = """
import json, torch
if not torch.cuda.is_available():
    print(json.dumps({"error": "PyTorch sees no CUDA GPU (torch.cuda.is_available() is False)"}))
else:
    p = torch.cuda.get_device_properties(0)
    print(json.dumps({"name": p.name, "total_bytes": p.total_memory, "torch": torch.__version__}))
"""


SDPA_PROBE = r"""
import contextlib, json, torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F
b, h, s, d = 4, 16, 4096, 128
q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
flops = 4 * b * s * s * h * d / 2  # causal: half the square, as the cost model counts
def timed(backends):
    ctx = sdpa_kernel(backends) if backends else contextlib.nullcontext()
    with ctx:
        for _ in range(3):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        torch.cuda.synchronize()
        e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        fwd = bwd = 0.0
        for _ in range(10):
            e[0].record(); o = F.scaled_dot_product_attention(q, k, v, is_causal=True); e[1].record()
            o.backward(torch.ones_like(o)); e[2].record(); torch.cuda.synchronize()
            fwd += e[0].elapsed_time(e[1]) / 10; bwd += e[1].elapsed_time(e[2]) / 10
    return {"fwd_tflops": flops / fwd / 1e9, "bwd_tflops": 2.5 * flops / bwd / 1e9}
out = {"cudnn_version": torch.backends.cudnn.version()}
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    torch.cuda.synchronize()
names = sorted({e.name for e in prof.events() if "sdpa" in e.name.lower() or "flash" in e.name.lower()
                or "attention" in e.name.lower() or "fmha" in e.name.lower()})
out["default_kernels"] = names[:8]
out["default"] = timed(None)
for name, be in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
    try:
        out[name] = timed([be])
    except RuntimeError as err:
        out[name] = {"error": str(err).splitlines()[0][:200]}
print(json.dumps(out))
"""


LOSS_PROBE = r"""
import json, torch
import torch.nn.functional as F
# torchtitan's loss of December 2024 (train.py at 9dec370): cross_entropy on an fp32 copy of
# the bf16 logits, the logits freed (`del pred`) before backward. Llama 3.1 8B's head at
# 2 x 8,192 tokens: how many fp32 logit-sized tensors are live at the loss's own peak, beyond
# the inputs. The peak is read when the fp32 copy's gradient arrives (after log_softmax's
# backward, before the head's backward allocates the inputs' gradients).
tokens, d, vocab = 16384, 4096, 128256
x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(d, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
labels = torch.randint(0, vocab, (tokens,), device="cuda")
(x[:8] @ w).sum().backward()  # cuBLAS's workspace, allocated before the baseline
x.grad = w.grad = None
torch.cuda.synchronize()
base = torch.cuda.memory_allocated()
torch.cuda.reset_peak_memory_stats()
marks = []
pred = x @ w
pf = pred.float()
pf.register_hook(lambda g: marks.append(torch.cuda.max_memory_allocated()))
loss = F.cross_entropy(pf, labels)
del pred, pf
loss.backward()
torch.cuda.synchronize()
unit = tokens * vocab * 4
print(json.dumps({
    "fp32_logits_gib": unit / 2**30,
    "loss_peak_fp32_logits": (marks[0] - base) / unit,
    "step_peak_fp32_logits": (torch.cuda.max_memory_allocated() - base) / unit,
    "reserved_minus_allocated_gib":
        (torch.cuda.max_memory_reserved() - torch.cuda.max_memory_allocated()) / 2**30,
}))
"""


SAC_PROBE = r"""
import json, functools, os, torch
import torch.nn as nn
import torch.nn.functional as F
from collections import defaultdict
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, CheckpointPolicy
dev = "cuda" if torch.cuda.is_available() else "cpu"
# SAC_COMPILE=1: each checkpointed block compiled, as torchtitan compiles its blocks (its
# published compiled peaks are 5 GiB under the eager ones; docs/published-runs.md item 22).
compiled = os.environ.get("SAC_COMPILE") == "1"
# torchtitan's Llama 3 8B block (dim 4096, 32 heads, 8 KV heads, FFN 14,336) under its op-level
# selective checkpointing (mm outputs but every second one, SDPA's), 8,192 tokens: the bytes
# a block keeps from its forward to its backward, per token.
dim, heads, kv, ffn, tokens, blocks = 4096, 32, 8, 14336, 8192, 4
if dev == "cpu":
    dim, heads, kv, ffn, tokens, blocks = 64, 4, 2, 224, 32, 2
hd = dim // heads
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk = nn.Linear(dim, dim, bias=False), nn.Linear(dim, kv * hd, bias=False)
        self.wv, self.wo = nn.Linear(dim, kv * hd, bias=False), nn.Linear(dim, dim, bias=False)
        self.w1, self.w2 = nn.Linear(dim, ffn, bias=False), nn.Linear(ffn, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)
        self.n1, self.n2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
    def forward(self, x):
        h = self.n1(x)
        q = self.wq(h).view(1, tokens, heads, hd).transpose(1, 2)
        k = self.wk(h).view(1, tokens, kv, hd).transpose(1, 2)
        v = self.wv(h).view(1, tokens, kv, hd).transpose(1, 2)
        k = k.repeat_interleave(heads // kv, 1)
        v = v.repeat_interleave(heads // kv, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(1, tokens, dim))
        h = self.n2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))
save = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention.default}
def context():
    meta = defaultdict(int)
    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            meta[f"{mode}_mm"] += 1
        keep = func in save and not (func == torch.ops.aten.mm.default and meta[f"{mode}_mm"] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)
model = nn.ModuleList(Block() for _ in range(blocks)).to(dev, torch.bfloat16)
x = torch.randn(1, tokens, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
mem = (lambda: torch.cuda.memory_allocated()) if dev == "cuda" else (lambda: 0)
reserved = (lambda: torch.cuda.memory_reserved()) if dev == "cuda" else (lambda: 0)
def run(b, h):
    return checkpoint(b, h, use_reentrant=False, context_fn=context)
# One compiled function for every block (modules are inlined, so it is compiled once).
step = torch.compile(run) if compiled else run
steps = [functools.partial(step, b) for b in model]
if compiled:  # compile outside the measurement: one throwaway pass
    h = x
    for s in steps:
        h = s(h)
    h.float().sum().backward()
    x.grad = None
    for p in model.parameters():
        p.grad = None
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
held, held_reserved = [], []
h = x
before, before_reserved = mem(), reserved()
for s in steps:
    h = s(h)
    held.append(mem() - before)
    held_reserved.append(reserved() - before_reserved)
h.float().sum().backward()
per_block = (held[-1] - held[0]) / (blocks - 1)
# The cost model's figure: the block's input and the kept outputs in bf16 (wq, wv, w1, w2,
# attention); attention's fp32 log-sum-exp (4 bytes a head) is not priced.
print(json.dumps({"compiled": compiled,
                  "kept_bytes_per_token_per_block": per_block / tokens,
                  "reserved_growth_bytes_per_token_per_block":
                      (held_reserved[-1] - held_reserved[0]) / (blocks - 1) / tokens,
                  "priced_bytes_per_token_per_block": 2 * (dim + dim + kv * hd + ffn + dim + dim),
                  "log_sum_exp_bytes_per_token": 4 * heads,
                  "sdpa_backends_enabled": {"flash": torch.backends.cuda.flash_sdp_enabled(),
                                            "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                                            "efficient": torch.backends.cuda.mem_efficient_sdp_enabled()}}))
"""


def python_probe(args, code, label, env=None, timeout=120):
    # One probe script in its own process: the JSON object its last line prints.
    res = subprocess.run([args.python, "-c", code], capture_output=True, text=True,
                         timeout=timeout, env=env)
    if res.returncode != 0:
        raise StepFailed(f"{label}: {res.stderr.strip()[-300:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def keep_probe(out, summary, key, probe):
    (out / f"{key}.json").write_text(json.dumps(probe, indent=1) + "\n")
    log(f"{key}: {probe}")
    summary[key] = probe
    return probe


def sac_probe(args, out, summary):
    # docs/published-runs.md item 21: what a Llama 3 8B block keeps under torchtitan's op-level
    # selective checkpointing, per token, against the bytes the cost model prices it to hold;
    # eager and with each block compiled (item 22: the compiled peaks are 5 GiB lower).
    probe = {"eager": python_probe(args, SAC_PROBE, "SAC probe (eager)",
                                   env=dict(os.environ, SAC_COMPILE="0"))}
    try:  # compile may fail where eager runs: keep the eager figures either way
        probe["compiled"] = python_probe(args, SAC_PROBE, "SAC probe (compiled)",
                                         env=dict(os.environ, SAC_COMPILE="1"), timeout=300)
    except (StepFailed, subprocess.TimeoutExpired) as err:
        probe["compiled"] = {"error": str(err)[-300:]}
    return keep_probe(out, summary, "sac", probe)


def loss_probe(args, out, summary):
    # docs/published-runs.md item 21: the cost model prices torchtitan's loss as 3 fp32
    # logit-sized tensors at its peak (the graph's log-probabilities and
    # stack.loss_fp32_logit_copies 2, the logits freed), as the code reads. Each segment mode,
    # as its own process; what the allocator keeps reserved beyond the peak, in GiB.
    # Item 22 predicts that excess: the bf16 logits' segment, left cached and empty (about
    # 3.9 GiB, pools::loss_hole_bytes), in both modes.
    probe = {mode: python_probe(args, LOSS_PROBE, f"loss probe ({mode})",
                                env=dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=mode))
             for mode in ("expandable_segments:True", "expandable_segments:False")}
    return keep_probe(out, summary, "loss", probe)


def sdpa_probe(args, out, summary):
    # Which kernels PyTorch's SDPA runs here by default, and each backend's causal bf16 rate at
    # head dim 128 and 4k (the cost model prices Hopper with cuDNN's: HOPPER_SDPA_*_RATES).
    return keep_probe(out, summary, "sdpa", python_probe(args, SDPA_PROBE, "SDPA probe"))


def query_gpu(py):
    res = subprocess.run([py, "-c", GPU_QUERY], capture_output=True, text=True)
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"cannot ask PyTorch about the GPU: {res.stderr.strip()[-300:]}"}


def layout_for(gpu_name):
    return ROOT / "layouts" / ("h200-1x.json" if "H200" in gpu_name else "h100-1x.json")


# ---- osdp-tui ----

def plan(bin_, model, layout, budget, out, extra=()):
    res = run([bin_, "plan", model, "--layout", layout, "--budget", budget, "--json", "-o", out,
               *extra])
    return json.loads(res.stdout)


def evaluate(bin_, model, layout, plan_file):
    """The plan priced on another layout: (step seconds, peak bytes)."""
    res = run([bin_, "evaluate", model, "--layout", layout, "--plan", plan_file, "--json"])
    e = json.loads(res.stdout)
    return e["step_time_s"], e["peak_memory_bytes"]


# Each training run's `train --json` report, by its metrics file.
REPORTS = {}


def train(bin_, model, plan_file, steps, metrics, device, extra=(), env=None):
    Path(metrics).unlink(missing_ok=True)
    res = run([bin_, "train", model, "--plan", plan_file, "--device", device, "--steps", steps,
               "--metrics", metrics, "--json", *extra], env=env)
    try:
        REPORTS[str(metrics)] = json.loads(res.stdout)
    except ValueError:
        REPORTS[str(metrics)] = {}
    return read_steps(metrics)


def summarise(steps, warmup):
    timed = steps[warmup:] or steps
    step_s = statistics.median(s["step_time_s"] for s in timed)
    ledger = max(max(s["memory_bytes"]) for s in steps)
    dev = [d for s in steps for d in (s.get("device_memory") or [])]

    def top(key):
        vals = [d[key] for d in dev if d.get(key) is not None]
        return max(vals) if vals else None

    return {"step_s": step_s, "ledger_peak_bytes": ledger,
            "allocated_peak_bytes": top("allocated_peak_bytes"),
            "reserved_peak_bytes": top("reserved_peak_bytes"),
            "process_bytes": top("process_bytes")}


def model_flops_per_sample(model_json):
    ops = json.loads(Path(model_json).read_text())["ops"]
    return 3 * sum(o.get("fwd_flops_per_sample", 0) for o in ops)


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


def eager_child(model_json, batch, steps, warmup, profile=False):
    """Runs in its own process (`--eager-child`); prints one JSON line. With `profile`, the
    last step runs under torch.profiler and its top CUDA kernels go to stderr."""
    import torch
    import torch.nn.functional as F

    cfg = json.loads(Path(model_json).read_text())["config"]
    torch.manual_seed(0)
    model = eager_model(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    seq, vocab = cfg["seq_len"], cfg["vocab_size"]
    torch.cuda.reset_peak_memory_stats()
    def step():
        ids = torch.randint(0, vocab, (batch, seq + 1), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    times = []
    try:
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    except torch.cuda.OutOfMemoryError:
        print(json.dumps({"oom": True}))
        return
    if profile:
        from torch.profiler import profile as prof, ProfilerActivity
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            step()
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=25), file=sys.stderr)
    print(json.dumps({"step_s": statistics.median(times[warmup:] or times),
                      "allocated_peak_bytes": torch.cuda.max_memory_allocated(),
                      "reserved_peak_bytes": torch.cuda.max_memory_reserved()}))


def eager(py, model_json, batch, steps, warmup, profile=False):
    """PyTorch eager at `batch`, halving it on out-of-memory; `batch` in the result is the one
    it ran at."""
    while batch >= 1:
        res = subprocess.run([py, __file__, "--eager-child", str(model_json), str(batch),
                              str(steps), str(warmup)] + (["profile"] if profile else []),
                             capture_output=True, text=True)
        if profile:
            log("eager profile of the last step:\n" + res.stderr[-6000:])
        try:
            out = json.loads(res.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            raise StepFailed(f"PyTorch eager failed: {res.stderr.strip()[-400:]}")
        if not out.get("oom"):
            out["batch"] = batch
            return out
        log(f"eager: out of memory at micro-batch {batch}; trying {batch // 2}")
        batch //= 2
    raise StepFailed("PyTorch eager is out of memory even at micro-batch 1")


# ---- the check ----

def smoke(args, out, summary):
    """Tiny models on the CPU (fp32) and the GPU (bf16): same seed, same data, same plan."""
    rows = []
    for name in ("tiny-gpt2", "tiny-llama"):
        model = ROOT / "sample-models" / f"{name}.json"
        plan_file = out / f"smoke.{name}.plan.json"
        run([args.bin, "plan", model, "--layout", ROOT / "layouts/cpu.json", "--budget", "1GiB",
             "--batch", "8", "-o", plan_file])
        cpu = train(args.bin, model, plan_file, args.smoke_steps, out / f"smoke.{name}.cpu.jsonl",
                    "cpu", ["--data", "shakespeare"])
        log(f"smoke {name}: CPU done ({len(cpu)} steps); now the GPU")
        gpu = train(args.bin, model, plan_file, args.smoke_steps,
                    out / f"smoke.{name}.cuda.jsonl", "cuda", ["--data", "shakespeare"])
        bad = [s["step"] for s in gpu if s.get("loss") is None or s.get("grad_norm") is None]
        if bad:
            raise StepFailed(f"smoke {name}: the GPU's loss or gradient norm is not finite from "
                             f"step {bad[0]} (steps {bad[:5]}); the CPU's are")
        diffs = [abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(cpu, gpu)]
        row = {"model": name, "steps": len(gpu), "max_rel_loss_diff": max(diffs),
               "first_loss": gpu[0]["loss"], "last_loss": gpu[-1]["loss"],
               # bf16 keeps 8 bits of mantissa: a few parts in a hundred over 20 steps.
               "within_bf16_tolerance": max(diffs) < 0.02}
        log(f"smoke {name}: GPU bf16 vs CPU fp32 losses differ by at most "
            f"{100 * row['max_rel_loss_diff']:.2f} %")
        rows.append(row)
    summary["smoke"] = rows


def measure_model(args, out, name, layouts, peak_bf16, gpu):
    """`layouts`: {"calibrated": path or None, "datasheet": path}. The plan is the calibrated
    layout's where there is one; it is priced on both."""
    model = ROOT / "sample-models" / f"{name}.json"
    plan_file = out / f"{name}.plan.json"
    planned_on = layouts.get("calibrated") or layouts["datasheet"]
    # One micro-batch a step (`--global-batch any`): the recipe's global batch would take
    # dozens of accumulated micro-batches a step on one GPU, minutes per model here.
    p = plan(args.bin, model, planned_on, args.budget, plan_file, ["--global-batch", "any"])
    log(f"{name}: plan micro-batch {p['batch_size']} × {p.get('accumulation', 1)} on "
        f"{Path(planned_on).name}, predicted step {1e3 * p['step_time_s']:.0f} ms, peak "
        f"{p['peak_memory_bytes'] / GIB:.1f} GiB")
    predicted = {}
    for which, path in layouts.items():
        if path is None:
            continue
        step_s, peak = evaluate(args.bin, model, path, plan_file)
        predicted[which] = {"step_s": step_s, "peak_bytes": peak}
    t0 = time.monotonic()
    steps = train(args.bin, model, plan_file, args.steps, out / f"{name}.jsonl", "cuda",
                  ["--data", "random"])
    wall_s = time.monotonic() - t0
    seq = json.loads(model.read_text())["config"]["seq_len"]
    m = summarise(steps, args.warmup)
    # What the run took beyond its steps: process start, weights' initialisation, placing them
    # on the GPU, the first kernels' set-up.
    m["startup_s"] = wall_s - sum(st["step_time_s"] for st in steps)
    batch = p["batch_size"] * p.get("accumulation", 1)
    row = {"model": name, "gpu": gpu, "batch": batch, "micro_batch": p["batch_size"],
           "planned_on": Path(planned_on).name,
           "tokens_per_s": batch * seq / m["step_s"],
           "mfu": model_flops_per_sample(model) * batch / m["step_s"] / peak_bf16,
           "predicted_step_s": p["step_time_s"],
           "predicted_peak_bytes": p["peak_memory_bytes"],
           "predicted": predicted,
           "predicted_overhead_bytes": p["prediction"]["overhead_bytes"],
           # The linears whose GEMMs the executor ran padded (`train --json`): on a GPU in bf16
           # GPT-2's 50,257-row head, forward and backward.
           "padded_linears": REPORTS.get(str(out / f"{name}.jsonl"), {}).get("padded_linears", []),
           **m}
    log(f"{name}: {row['tokens_per_s']:.0f} tokens/s, MFU {100 * row['mfu']:.1f} %, "
        f"{m['startup_s']:.1f} s before and between steps, step "
        f"{1e3 * m['step_s']:.0f} ms (predicted " + ", ".join(
            f"{k} {1e3 * v['step_s']:.0f}" for k, v in predicted.items()) + ")")
    if not args.skip_validate and (args.validate is None or name in args.validate.split(",")):
        try:
            v = json.loads(run([args.bin, "validate", model, "--layout", planned_on, "--plan",
                                plan_file, "--steps", "4", "--warmup", "2", "--json"],
                               timeout=180).stdout)
            row["validate"] = {"step_s": v["measured"]["step_time_s"],
                               "optimizer_s": v["measured"]["optimizer_s"],
                               "other_s": v["measured"]["other_s"],
                               "predicted_optimizer_s": v["predicted"]["optimizer_s"],
                               "by_kind": v["compute_by_kind"]}
            log(f"{name}: validate (a sync per op): step {1e3 * v['measured']['step_time_s']:.0f} "
                f"ms, optimizer {1e3 * v['measured']['optimizer_s']:.0f} ms (predicted "
                f"{1e3 * v['predicted']['optimizer_s']:.0f}); by kind measured/predicted ms: "
                + ", ".join(f"{k} {1e3 * f['measured_s']:.0f}/{1e3 * f['predicted_s']:.0f}"
                            for k, f in v["compute_by_kind"].items()))
        except (StepFailed, KeyError, json.JSONDecodeError) as err:
            row["validate_error"] = str(err)
    if not args.skip_eager:
        try:
            e = eager(args.python, model, p["batch_size"], args.steps, args.warmup,
                      profile=args.profile_eager and name == args.profile_eager)
            row.update(eager_batch=e["batch"], eager_tokens_per_s=e["batch"] * seq / e["step_s"],
                       eager_reserved_peak_bytes=e["reserved_peak_bytes"])
            log(f"{name}: eager {row['eager_tokens_per_s']:.0f} tokens/s at micro-batch "
                f"{e['batch']}")
        except StepFailed as err:
            row["eager_error"] = str(err)
    (out / f"{name}.json").write_text(json.dumps(row, indent=2))
    return row


def calibrate(args, out, summary):
    target = out / "calibrated.json"
    res = run([args.bin, "calibrate", "--device", "cuda", "--quick", "-o", target, "--json"],
              timeout=240)
    layout = json.loads(res.stdout)
    eff = layout["device"].get("efficiency", {})
    summary["calibration"] = {k: v["value"] for k, v in eff.items() if isinstance(v, dict)}
    summary["calibration"]["host_link_gb_per_s"] = (layout.get("host") or {}).get(
        "link_gb_per_s", {}).get("value")
    summary["calibration"]["device"] = layout["device"]["model"]
    log("calibrated: " + ", ".join(f"{k} {v:.3g}" for k, v in summary["calibration"].items()
                                   if isinstance(v, float)))
    return target


def once_frame(args, out, name, layout):
    model = ROOT / "sample-models" / f"{name}.json"
    env = dict(os.environ, COLUMNS="160", LINES="48")
    res = run([args.bin, model, "--layout", layout, "--budget", args.budget, "--once"],
              env=env, timeout=60)
    (out / "once.txt").write_text(res.stdout)
    log(f"dashboard frame of {name} on {Path(layout).name}: {len(res.stdout.splitlines())} lines "
        "in once.txt")


def split_study(args, out, name, layout):
    model = ROOT / "sample-models" / f"{name}.json"
    ops = json.loads(model.read_text())["ops"]
    # A tied weight (GPT-2's lm_head) lives with its embedding: the planner refuses to pin it.
    untied = [o for o in ops if o["kind"] == "linear" and o["params"]
              and not any(q.get("tied_to") for q in o["params"])]
    linear = max(untied, key=lambda o: math.prod(o["params"][0]["shape"]))
    rows = []
    for k in (1, 4, 8):
        f = out / f"{name}.split{k}.plan.json"
        p = plan(args.bin, model, layout, args.budget, f, ["--pin", f"{linear['id']}=zero3/{k}:{k}", "--global-batch", "any"])
        steps = train(args.bin, model, f, args.steps, out / f"{name}.split{k}.jsonl", "cuda",
                      ["--data", "random"])
        m = summarise(steps, args.warmup)
        rows.append({"split": k, "op": linear["id"], "batch": p["batch_size"], **m})
    return rows


def train_again(args, out, name, label, **env):
    """Model `name` trained again under its measured plan with `env` added to the environment;
    its summary. The run's steps land in NAME.LABEL.jsonl."""
    steps = train(args.bin, ROOT / "sample-models" / f"{name}.json", out / f"{name}.plan.json",
                  args.steps, out / f"{name}.{label}.jsonl", "cuda", ["--data", "random"],
                  dict(os.environ, **env))
    return summarise(steps, args.warmup)


def allocator_study(args, out, rows):
    """The model whose allocator kept the most beyond its allocated peak, trained again with
    PyTorch's expandable segments: how much of the reserved slack is fragmentation."""
    row = max(rows, key=lambda r: (r["reserved_peak_bytes"] or 0) - (r["allocated_peak_bytes"] or 0))
    name = row["model"]
    m = train_again(args, out, name, "expandable", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    res = {"model": name, "default": {k: row[k] for k in m}, "expandable_segments": m}
    log(f"{name} with expandable segments: reserved peak {fmt_bytes(m['reserved_peak_bytes'])} "
        f"GiB (default {fmt_bytes(row['reserved_peak_bytes'])}), allocated "
        f"{fmt_bytes(m['allocated_peak_bytes'])} GiB, step {1e3 * m['step_s']:.0f} ms "
        f"(default {1e3 * row['step_s']:.0f})")
    return res


def padding_study(args, out, rows):
    """The first model whose LM head is not a multiple of 8 wide (GPT-2's 50,257), trained
    again with the trainer's zero-row padding off (OSDP_GEMM_PADDING=0): what the padding
    saves a step."""
    def unaligned(r):
        # The trainer's rule (osdp_core::cost::padded_gemm_rows): not a multiple of 8, and a
        # multiple of 64 adds under 1 %.
        cfg = json.loads((ROOT / "sample-models" / f"{r['model']}.json").read_text())["config"]
        v = cfg.get("vocab_size", cfg.get("vocab", 0))
        return v % 8 != 0 and (-v % 64) * 100 < v
    row = next((r for r in rows if unaligned(r)), None)
    if row is None:
        log("padding: no model with an unaligned head")
        return None
    name = row["model"]
    m = train_again(args, out, name, "unpadded", OSDP_GEMM_PADDING="0")
    res = {"model": name, "padded": {k: row[k] for k in m}, "unpadded": m,
           "padded_linears": row.get("padded_linears", []),
           "unpadded_linears": REPORTS.get(str(out / f"{name}.unpadded.jsonl"), {}).get(
               "padded_linears", [])}
    log(f"{name}: padded linears as run {res['padded_linears']}; with OSDP_GEMM_PADDING=0 "
        f"{res['unpadded_linears']}")
    log(f"{name} without padding: step {1e3 * m['step_s']:.0f} ms (padded "
        f"{1e3 * row['step_s']:.0f}), reserved peak {fmt_bytes(m['reserved_peak_bytes'])} GiB "
        f"(padded {fmt_bytes(row['reserved_peak_bytes'])})")
    return res


def fmt_bytes(b):
    return "-" if b is None else f"{b / GIB:.1f}"


def write_report(out, summary, args):
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    lines = [f"GPU: {summary.get('gpu', '?')} · layout {summary.get('layout', '?')} · "
             f"{summary['date']} · {args.steps} steps, median after {args.warmup} · budget "
             f"{args.budget}", ""]
    if summary.get("smoke"):
        lines += ["| smoke | steps | GPU bf16 vs CPU fp32 loss, max rel. diff | within bf16 |",
                  "|---|---|---|---|"]
        for s in summary["smoke"]:
            lines.append(f"| {s['model']} | {s['steps']} | {100 * s['max_rel_loss_diff']:.2f} % | "
                         f"{'yes' if s['within_bf16_tolerance'] else 'NO'} |")
        lines.append("")
    if summary.get("models"):
        lines += ["| model | batch | tokens/s | MFU | eager tokens/s (batch) | ratio | "
                  "step measured / predicted calibrated, datasheet | "
                  "peak GiB: ledger / alloc. reserved / NVML / predicted | start-up |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in summary["models"]:
            et = r.get("eager_tokens_per_s")
            eager_s = f"{et:.0f} ({r['eager_batch']})" if et else r.get("eager_error", "-")
            ratio = f"{r['tokens_per_s'] / et:.2f}" if et else "-"
            lines.append(
                f"| {r['model']} | {r['batch']} | {r['tokens_per_s']:.0f} | "
                f"{100 * r['mfu']:.1f} % | {eager_s} | {ratio} | "
                f"{r['step_s'] * 1e3:.0f} / " + ", ".join(
                    f"{v['step_s'] * 1e3:.0f}" for v in r.get("predicted", {}).values())
                + " ms | "
                f"{fmt_bytes(r['ledger_peak_bytes'])} / {fmt_bytes(r['reserved_peak_bytes'])} / "
                f"{fmt_bytes(r['process_bytes'])} / {fmt_bytes(r['predicted_peak_bytes'])} | "
                f"{r.get('startup_s', float('nan')):.1f} s |")
        lines.append("")
    if summary.get("split"):
        lines += [f"Splitting {summary['split'][0]['op']}:", "",
                  "| split | step | ledger peak | reserved peak |", "|---|---|---|---|"]
        for s in summary["split"]:
            lines.append(f"| {s['split']} | {s['step_s'] * 1e3:.1f} ms | "
                         f"{fmt_bytes(s['ledger_peak_bytes'])} GiB | "
                         f"{fmt_bytes(s['reserved_peak_bytes'])} GiB |")
        lines.append("")
    if summary.get("allocator"):
        a = summary["allocator"]
        lines += [f"Allocator, {a['model']}: reserved peak {fmt_bytes(a['default']['reserved_peak_bytes'])}"
                  f" GiB by default, {fmt_bytes(a['expandable_segments']['reserved_peak_bytes'])} GiB"
                  f" with expandable segments (allocated {fmt_bytes(a['default']['allocated_peak_bytes'])}"
                  f" / {fmt_bytes(a['expandable_segments']['allocated_peak_bytes'])}); step "
                  f"{a['default']['step_s'] * 1e3:.0f} / {a['expandable_segments']['step_s'] * 1e3:.0f} ms", ""]
    if summary.get("padding"):
        g = summary["padding"]
        lines += [f"Padding, {g['model']}: step {g['padded']['step_s'] * 1e3:.0f} ms with the head "
                  f"padded, {g['unpadded']['step_s'] * 1e3:.0f} ms without (OSDP_GEMM_PADDING=0); "
                  f"reserved peak {fmt_bytes(g['padded']['reserved_peak_bytes'])} / "
                  f"{fmt_bytes(g['unpadded']['reserved_peak_bytes'])} GiB; ran padded: "
                  + (", ".join(f"{p['op']} {p['rows']}→{p['padded_rows']} rows (forward "
                               f"{p['forward']}, backward {p['backward']})"
                               for p in g.get("padded_linears", [])) or "nothing"), ""]
    if summary.get("layout_local"):
        l = summary["layout_local"]
        lines += [f"Local layout: {l['model']}, compute capability {l['compute_capability']}, "
                  f"bf16 {l['bf16_tflops']} TFLOP/s ({l['rates']})", ""]
    if summary.get("sdpa"):
        p = summary["sdpa"]
        rates = ", ".join(f"{k} {v['fwd_tflops']:.0f} / {v['bwd_tflops']:.0f}"
                          for k, v in p.items() if isinstance(v, dict) and "fwd_tflops" in v)
        lines += [f"SDPA (causal bf16, head dim 128, 4k; TFLOP/s forward / backward): {rates}; "
                  f"cuDNN {p.get('cudnn_version')}, default kernels {p.get('default_kernels')}", ""]
    if summary.get("loss"):
        lines += ["torchtitan's loss (fp32 logit-sized tensors live at its peak, priced 3; "
                  "reserved beyond the allocated peak): " + "; ".join(
                      f"{mode} {p['loss_peak_fp32_logits']:.2f} "
                      f"(whole step {p['step_peak_fp32_logits']:.2f}), "
                      f"{p['reserved_minus_allocated_gib']:.2f} GiB"
                      for mode, p in summary["loss"].items()), ""]
    if summary.get("sac"):
        kept = "; ".join(
            f"{mode} {p['kept_bytes_per_token_per_block']:.0f} B a token (reserved grows "
            f"{p['reserved_growth_bytes_per_token_per_block']:.0f}), priced "
            f"{p['priced_bytes_per_token_per_block']} B" if "error" not in p
            else f"{mode} failed: {p['error']}"
            for mode, p in summary["sac"].items())
        lines += [f"Op-level selective checkpointing, Llama 3 8B block: {kept}", ""]
    if summary.get("calibration"):
        lines.append("Calibrated: " + ", ".join(
            f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
            for k, v in summary["calibration"].items()))
        lines.append("")
    for s in summary.get("skipped", []):
        lines.append(f"SKIPPED {s}")
    for f in summary["failures"]:
        lines.append(f"FAILED {f['step']}: {f['error']}")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.environ.get("OSDP_BIN", str(ROOT / "target/release/osdp-tui")))
    ap.add_argument("--python", default=sys.executable,
                    help="the Python whose PyTorch runs the eager reference")
    ap.add_argument("--models", default="gpt2-medium,gpt2-xl,tinyllama-1.1b")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--smoke-steps", type=int, default=20)
    ap.add_argument("--budget", default=None,
                    help="per-GPU memory budget for the plans (default: 70 %% of the GPU)")
    ap.add_argument("--out", default=str(ROOT / "runs/gpu-check"))
    ap.add_argument("--skip-eager", action="store_true")
    ap.add_argument("--skip-split", action="store_true")
    ap.add_argument("--skip-calibrate", action="store_true")
    ap.add_argument("--skip-allocator", action="store_true",
                    help="skip training the model with the most allocator slack again with "
                         "expandable segments")
    ap.add_argument("--skip-padding", action="store_true",
                    help="skip training the first model with an unaligned head again without "
                         "the trainer's zero-row padding")
    ap.add_argument("--skip-validate", action="store_true",
                    help="skip `validate` (per-kind times, a synchronisation per op) per model")
    ap.add_argument("--validate", default=None, metavar="MODELS",
                    help="validate only these models (comma-separated; default every model)")
    ap.add_argument("--profile-eager", default="", metavar="MODEL",
                    help="print PyTorch eager's top CUDA kernels of one step of this model")
    ap.add_argument("--deadline-s", type=float, default=460,
                    help="whole-check time budget: a step that would overrun it is skipped")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"date": time.strftime("%Y-%m-%d"), "failures": [], "models": [], "split": [],
               "skipped": []}
    started = time.monotonic()

    def attempt(step, fn, needs_s=0):
        left = args.deadline_s - (time.monotonic() - started)
        if left < needs_s:
            msg = f"{step}: {left:.0f} s left of --deadline-s {args.deadline_s:.0f}, it needs ~{needs_s} s"
            log(f"SKIPPED {msg}")
            summary["skipped"].append(msg)
            write_report(out, summary, args)
            return None
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - every failure is recorded and the check goes on
            msg = str(err) if isinstance(err, StepFailed) else traceback.format_exc().strip().splitlines()[-1]
            log(f"FAILED {step}: {msg}")
            summary["failures"].append({"step": step, "error": msg})
            return None
        finally:
            write_report(out, summary, args)

    gpu = query_gpu(args.python)
    if "error" in gpu:
        log(f"no GPU: {gpu['error']}; running the smoke test anyway to reach the CUDA step")
        summary["gpu"] = "none"
    else:
        summary.update(gpu=gpu["name"], torch=gpu["torch"])
        log(f"GPU: {gpu['name']}, {gpu['total_bytes'] / GIB:.1f} GiB, PyTorch {gpu['torch']}")
    if args.budget is None:
        total = gpu.get("total_bytes", 80 * GIB)
        args.budget = f"{int(0.7 * total) // 2**20}MiB"
    layout = layout_for(gpu.get("name", ""))
    summary["layout"] = layout.name
    peak_bf16 = json.loads(layout.read_text())["device"]["dense_tflops"]["bf16"]["value"] * 1e12

    def local_layout():
        # What the dashboard plans for on this machine (`osdp-tui layout local`): NVML's name,
        # its row's datasheet rates, the compute capability.
        d = json.loads(run([args.bin, "layout", "local", "--json"]).stdout)["device"]
        res = {"model": d["model"], "compute_capability": d.get("compute_capability"),
               "bf16_tflops": (d["dense_tflops"].get("bf16") or {}).get("value"),
               "rates": (d["dense_tflops"].get("bf16") or {}).get("source", "")}
        log(f"layout local: {res}")
        summary["layout_local"] = res
        return res

    layouts = {"calibrated": None, "datasheet": layout}
    if not args.skip_calibrate:
        layouts["calibrated"] = attempt("calibrate", lambda: calibrate(args, out, summary), 30)
    attempt("layout-local", local_layout, 5)
    if "error" not in gpu:
        attempt("sdpa", lambda: sdpa_probe(args, out, summary), 20)
        attempt("loss", lambda: loss_probe(args, out, summary), 20)
        attempt("sac", lambda: sac_probe(args, out, summary), 90)
    attempt("smoke", lambda: smoke(args, out, summary), 30)
    if any(f["step"] == "smoke" for f in summary["failures"]):
        lines = write_report(out, summary, args)
        print("\n".join(lines))
        log("the GPU cannot train the smoke models; stopping before the expensive ones")
        return 1
    models = [m for m in args.models.split(",") if m]
    for name in models:
        row = attempt(name, lambda name=name: measure_model(args, out, name, layouts, peak_bf16,
                                                            summary["gpu"]), 60)
        if row:
            summary["models"].append(row)
    if models and not args.skip_split:
        rows = attempt("split", lambda: split_study(args, out, models[0], layout), 60)
        summary["split"] = rows or []
    if summary["models"] and not args.skip_padding:
        summary["padding"] = attempt("padding",
                                     lambda: padding_study(args, out, summary["models"]), 45)
    if summary["models"] and not args.skip_allocator:
        summary["allocator"] = attempt("allocator",
                                       lambda: allocator_study(args, out, summary["models"]), 45)
    if models:
        attempt("once", lambda: once_frame(args, out, models[-1],
                                           layouts["calibrated"] or layout), 10)
    lines = write_report(out, summary, args)
    print("\n".join(lines))
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    if len(sys.argv) in (6, 7) and sys.argv[1] == "--eager-child":
        eager_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
                    profile=len(sys.argv) == 7)
        sys.exit(0)
    sys.exit(main())
