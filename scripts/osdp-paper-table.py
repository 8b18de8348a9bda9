#!/usr/bin/env python3
"""Rows of docs/osdp-paper.md: the OSDP paper's settings planned at fixed global batches, beside
the six baselines. Run from the repository root after `cargo build --release`."""
import json, subprocess
B = "target/release/osdp-tui"
L="layouts/osdp-paper-8x-titan-rtx-pcie3.json"
rows=[]
settings=[("GPT 48×1536, 8 GiB","sample-models/osdp-gpt-48x1536.json","8GiB",[96,512]),
          ("GPT 48×2048, 8 GiB","sample-models/osdp-gpt-48x2048.json","8GiB",[40,256]),
          ("OPT-30B shape, 8 layers, 16 GiB","sample-models/opt-30b-8layers.json","16GiB",[24,96])]
spaces=[("OSDP's own (`--no-recompute --max-split 1`)",["--no-recompute","--max-split","1"]),("default (split + recompute)",[])]
def fmt(b):
    if not b["fits"]:
        return "needs ≥ %.1f GiB" % (b["needs_bytes"]/2**30)
    acc = b["accumulation"]
    lab = "%d×%d" % (b["batch_size"], acc) if acc>1 else "%d" % b["batch_size"]
    return "%.1f @%s" % (b["throughput_samples_per_s"], lab)
for name, model, budget, gbs in settings:
    for gb in gbs:
        for sname, extra in spaces:
            r=subprocess.run([B,"plan",model,"--layout",L,"--budget",budget,"--global-batch",str(gb),"--json",*extra],capture_output=True,text=True)
            if r.returncode!=0:
                rows.append(f"| {name} | {gb} | {sname} | {r.stderr.strip()} | | | | |"); continue
            p=json.loads(r.stdout)
            acc=p["accumulation"]; lab="%d×%d"%(p["batch_size"],acc) if acc>1 else "%d"%p["batch_size"]
            bl=p["baselines"]
            fs=[bl[k] for k in ("fsdp","fsdp+ckpt") if bl[k]["fits"]]
            if sname.startswith("OSDP"):
                fs=[bl["fsdp"]] if bl["fsdp"]["fits"] else []
            best=max(fs,key=lambda b:b["throughput_samples_per_s"]) if fs else None
            ratio="%.2f×"%(p["throughput_samples_per_s"]/best["throughput_samples_per_s"]) if best else "—"
            rows.append(f"| {name} | {gb} | {sname} | {p['throughput_samples_per_s']:.1f} @{lab} | {fmt(bl['fsdp'])} | {fmt(bl['fsdp+ckpt'])} | {fmt(bl['zero2'])} | {fmt(bl['ddp'])} | {ratio} |")
print("\n".join(rows))
