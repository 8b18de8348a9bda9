#!/usr/bin/env python3
"""Predicted vs measured peak memory per rank: the planner's figure for a plan on the `cpu`
layout against what the trainer's executor holds, for the tiny samples under three plans each.

Usage: scripts/memory-table.py [BINARY]   (a binary built with `--features train`;
default target/release/osdp-tui). Prints a Markdown table."""
import json, os, subprocess, sys, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target/release/osdp-tui")
LAYOUT = os.path.join(ROOT, "layouts/cpu.json")
WORLD, BATCH = 2, 4  # ranks of the cpu layout; micro-batch per rank


def run(*args):
    return subprocess.run([BIN, *args], check=True, capture_output=True, text=True).stdout


def planned(model, budget, out):
    run("plan", model, "--layout", LAYOUT, "--budget", budget, "--batch", str(BATCH), "-o", out)
    with open(out) as f:
        return json.load(f)


def rewrite(plan, choose):
    plan = json.loads(json.dumps(plan))
    for op in plan["ops"]:
        op.pop("memory_bytes", None)
        op.pop("time_s", None)
        if op["strategy"] != "none":
            op["strategy"], op["split"], op["sharded_slices"] = choose(op)
        op["recompute"] = op["recompute"] and choose is None
    return plan


def main():
    tmp = tempfile.mkdtemp()
    print("| model | plan | predicted peak (MiB) | measured peak (MiB) | measured / predicted |")
    print("|---|---|---:|---:|---:|")
    for name in ["tiny-gpt2", "tiny-llama", "tiny-opt"]:
        model = os.path.join(ROOT, f"sample-models/{name}.json")
        base = planned(model, "8GiB", os.path.join(tmp, "base.json"))
        linear = lambda op: op["id"].split(".")[-1] not in ("ln_1", "ln_2", "ln_f", "wte", "wpe") and "norm" not in op["id"] and "embed" not in op["id"]
        plans = {
            "dp everywhere": rewrite(base, lambda op: ("dp", 1, 0)),
            "zero3, linears split 4": rewrite(base, lambda op: ("zero3", 4, 4) if linear(op) else ("zero3", 1, 1)),
        }
        # The planner's own choice under a budget tight enough to make it mix strategies.
        mixed = None
        for mib in range(340, 420, 2):
            try:
                p = planned(model, f"{mib}MB", os.path.join(tmp, "mix.json"))
            except subprocess.CalledProcessError:
                continue
            kinds = {(o["strategy"], o["split"], o["recompute"]) for o in p["ops"] if o["strategy"] != "none"}
            if len(kinds) >= 3:
                mixed = (mib, p)
                break
        if mixed:
            for o in mixed[1]["ops"]:
                o.pop("memory_bytes", None)
                o.pop("time_s", None)
            plans[f"planner's choice at {mixed[0]} MB"] = mixed[1]
        for label, plan in plans.items():
            plan["batch_size"] = BATCH
            path = os.path.join(tmp, "plan.json")
            with open(path, "w") as f:
                json.dump(plan, f)
            pred = json.loads(run("evaluate", model, "--layout", LAYOUT, "--plan", path, "--json"))["prediction"]
            predicted = pred["peak_memory_bytes"] - pred["overhead_bytes"]
            metrics = os.path.join(tmp, "m.jsonl")
            run("train", model, "--plan", path, "--world-size", str(WORLD), "--steps", "3", "--metrics", metrics)
            with open(metrics) as f:
                steps = [json.loads(l) for l in f if json.loads(l)["event"] == "step"]
            measured = max(max(s["memory_bytes"]) for s in steps)
            mib = lambda b: b / 2**20
            print(f"| {name} | {label} | {mib(predicted):.2f} | {mib(measured):.2f} | {measured / predicted:.3f} |")


if __name__ == "__main__":
    main()
