#!/usr/bin/env python3
"""Predicted vs measured step time and peak memory on this machine's CPU: calibrate once, then
for each model run three plans (DDP everywhere; ZeRO-3 with the linears split in 4; the planner's
own mix under a budget tight enough to make it mix) through `osdp-tui validate --repeat N`, and
print the Markdown table docs/fidelity.md keeps.

Usage: scripts/fidelity.py [--bin BINARY] [--layout CALIBRATED.json] [--repeat N]
                           [--models a,b,c] [--batch N] [--json OUT.json]
BINARY must be built with `--features train` (default target/release/osdp-tui). Without
--layout the script calibrates first and writes runs/fidelity/local-cpu.json."""
import argparse, json, os, subprocess, sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(ROOT, "target/release/osdp-tui"))
    ap.add_argument("--layout")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--models", default="tiny-gpt2:4,tiny-llama:4,small-gpt2:2",
                    help="NAME:MICRO_BATCH,...")
    ap.add_argument("--json", help="also write every validate result here")
    args = ap.parse_args()
    out = os.path.join(ROOT, "runs/fidelity")
    os.makedirs(out, exist_ok=True)

    def run(*a):
        return subprocess.run([args.bin, *a], check=True, capture_output=True, text=True).stdout

    layout = args.layout
    if not layout:
        layout = os.path.join(out, "local-cpu.json")
        print(f"calibrating into {layout} ...", file=sys.stderr)
        run("calibrate", "-o", layout)

    def evaluate(model, plan):
        path = os.path.join(out, "plan.json")
        with open(path, "w") as f:
            json.dump(plan, f)
        return json.loads(run("evaluate", model, "--layout", layout, "--plan", path, "--json"))

    def planned(model, budget, batch):
        path = os.path.join(out, "planned.json")
        run("plan", model, "--layout", layout, "--budget", str(budget), "--batch", str(batch), "-o", path)
        with open(path) as f:
            return json.load(f)

    def rewrite(plan, choose):
        plan = json.loads(json.dumps(plan))
        for op in plan["ops"]:
            if op["strategy"] != "none":
                op["strategy"], op["split"], op["sharded_slices"] = choose(op)
            op["recompute"] = False
        return plan

    def kinds(plan):
        return {(o["strategy"], o["split"], o["sharded_slices"], o["recompute"])
                for o in plan["ops"] if o["strategy"] != "none"}

    results = []
    print(f"| model | plan | predicted step | measured step (median; min–max of {args.repeat}) | measured / predicted | "
          "predicted peak | measured peak | measured / predicted | CPU steal |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for item in args.models.split(","):
        name, batch = item.split(":")
        model = os.path.join(ROOT, f"sample-models/{name}.json")
        base = planned(model, "64GiB", batch)
        with open(model) as f:
            spec = json.load(f)
        linear = {o["id"] for o in spec["ops"] if o["kind"] == "linear"}
        plans = {
            "dp everywhere": rewrite(base, lambda op: ("dp", 1, 0)),
            "zero3, linears split 4": rewrite(
                base, lambda op: ("zero3", 4, 4) if op["id"] in linear else ("zero3", 1, 1)),
        }
        # The planner's own mix: budgets between the ZeRO-3 and the DDP peaks until it mixes.
        lo = evaluate(model, plans["zero3, linears split 4"])["peak_memory_bytes"]
        hi = evaluate(model, plans["dp everywhere"])["peak_memory_bytes"]
        best = None
        for i in range(1, 24):
            budget = lo + (hi - lo) * i // 24
            try:
                p = planned(model, budget, batch)
            except subprocess.CalledProcessError:
                continue
            if best is None or len(kinds(p)) > len(kinds(best[1])):
                best = (budget, p)
            if len(kinds(p)) >= 3:
                break
        if best:
            plans[f"planner's mix at {best[0] / 2**20:.0f} MiB"] = best[1]
        for k, (label, plan) in enumerate(plans.items()):
            for op in plan["ops"]:
                op.pop("memory_bytes", None)
                op.pop("time_s", None)
            path = os.path.join(out, f"{name}-plan{k + 1}.json")
            with open(path, "w") as f:
                json.dump(plan, f)
            v = json.loads(run("validate", model, "--layout", layout, "--plan", path,
                               "--repeat", str(args.repeat), "--steps", str(args.steps), "--json"))
            v["plan_label"] = label
            results.append(v)
            p, m = v["predicted"], v["measured"]
            reps = m["step_time_s_per_repeat"]
            ms = lambda s: f"{s * 1e3:.1f} ms"
            mib = lambda b: f"{b / 2**20:.2f} MiB"
            print(f"| {name} (b={batch}) | {label} | {ms(p['step_time_s'])} | {ms(m['step_time_s'])} "
                  f"({ms(min(reps))}–{ms(max(reps))}) | {v['ratio']['step_time']:.3f} | "
                  f"{mib(p['peak_memory_bytes'])} | {mib(m['peak_memory_bytes'])} | "
                  f"{v['ratio']['peak_memory']:.3f} | {100 * (v.get('cpu_steal_fraction') or 0):.1f} % |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
