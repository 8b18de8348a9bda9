//! Price every published run in `docs/published-runs.json` and print the table
//! `docs/published-runs.md` keeps; `--fit` also fits each GPU generation's matmul efficiency to
//! the runs marked `fit` and reports the error on the held-out ones.
//!
//! `cargo run --release --example published-runs -- [--fit] [--json] [--peaks]`; `--peaks`
//! prices DLRover/ATorch's published Llama-2-7B FSDP memory table (docs/published-runs.md).

use std::collections::BTreeMap;
use std::path::Path;

use osdp_core::cluster::{Figure, Layout};
mod runs;

use runs::{geometric_mean, price_run, price_run_tuned, read_runs, Priced, PublishedRun, Role};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let set = match read_runs(&root.join("docs/published-runs.json")) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("published-runs: {e}");
            std::process::exit(1);
        }
    };
    let layouts = root.join("layouts");
    let runs: Vec<&PublishedRun> = set
        .runs
        .iter()
        .filter(|r| r.role != Role::Excluded)
        .collect();

    if let Some(i) = args.iter().position(|a| a == "--breakdown") {
        let id = args.get(i + 1).cloned().unwrap_or_default();
        // A run priced for its memory only is broken down on its stand-in's rates.
        match set.runs.iter().find(|r| r.id == id) {
            Some(r) if r.role != Role::Excluded => breakdown(r, &layouts),
            Some(r) if r.memory_priced_on.is_some() => breakdown(&r.for_memory(), &layouts),
            Some(_) => eprintln!("published-runs: {id} is excluded (the data file says why)"),
            None => eprintln!("published-runs: no run {id}"),
        }
        return;
    }
    if args.iter().any(|a| a == "--peaks") {
        // Its throughput ratio is not used: only the plan's predicted memory is.
        match runs
            .iter()
            .find(|r| r.id == "fms-a100-llama2-7b-s4096-g128-hsdp-noac")
        {
            Some(llama) => peaks(llama, &layouts),
            None => eprintln!("published-runs: the data file has no Llama-2-7B A100 run"),
        }
        return;
    }
    if args.iter().any(|a| a == "--fit") {
        fit(&runs, &layouts);
    }

    let mut priced: Vec<(&PublishedRun, Priced)> = Vec::new();
    for r in &runs {
        match price_run(r, &layouts, &|_| {}) {
            Ok(p) => priced.push((r, p)),
            Err(e) => eprintln!("{}: not priced: {e}", r.id),
        }
    }
    if args.iter().any(|a| a == "--json") {
        let all: Vec<&Priced> = priced.iter().map(|(_, p)| p).collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&all).expect("serialisable")
        );
        return;
    }
    print_runs(&priced);
    println!();
    print_groups(&priced);
    // Runs left out of the throughput check whose memory can still be priced.
    let mut memory = priced;
    for r in set.runs.iter().filter(|r| r.memory_priced_on.is_some()) {
        match runs::price_memory(r, &layouts) {
            Ok(p) => memory.push((r, p)),
            Err(e) => eprintln!("{}: memory not priced: {e}", r.id),
        }
    }
    print_memory(&memory);
}

/// The table of runs: each published throughput beside the predicted one.
fn print_runs(priced: &[(&PublishedRun, Priced)]) {
    println!("| run | GPUs | model | seq | mb × acc | sharding | ckpt | published tok/s/GPU | predicted | ratio | role |");
    println!("|---|---:|---|---:|---|---|---|---:|---:|---:|---|");
    for (r, p) in priced {
        println!(
            "| [{}]({}) | {} | {} | {} | {} × {} | {} | {} | {:.0} | {:.0} | {:.2} | {} |",
            r.id,
            r.source.url,
            r.gpus(),
            r.model.name,
            r.seq_len,
            r.micro_batch,
            r.grad_accum.unwrap_or(1),
            r.sharding.as_deref().unwrap_or("?"),
            r.activation_checkpointing,
            p.published_tokens_per_s_per_gpu,
            p.predicted_tokens_per_s_per_gpu,
            p.ratio,
            match p.role {
                Role::Fit => "fit",
                Role::HeldOut => "held out",
                Role::Excluded => "excluded",
            }
        );
    }
}

/// The table of groups (fitted, held out, all; the new sources' held-out runs on their own):
/// how close the ratios are to 1.
fn print_groups(priced: &[(&PublishedRun, Priced)]) {
    let mut groups: BTreeMap<(bool, String, &str), Vec<f64>> = BTreeMap::new();
    for (_, p) in priced {
        let kind = match (p.new_source, p.role) {
            (true, _) => "new sources, held out",
            (false, Role::Fit) => "fitted",
            (false, _) => "held out",
        };
        groups
            .entry((p.new_source, p.group.clone(), kind))
            .or_default()
            .push(p.ratio);
        if !p.new_source {
            groups
                .entry((false, p.group.clone(), "all"))
                .or_default()
                .push(p.ratio);
        }
    }
    // Where a group holds figures that do not time a steady step (or do not say), the same
    // group without them on a row of its own: the cost model prices a steady step.
    let mixed: std::collections::BTreeSet<(bool, String)> = priced
        .iter()
        .filter(|(_, p)| p.timing != runs::Timing::Step)
        .map(|(_, p)| (p.new_source, p.group.clone()))
        .collect();
    for (_, p) in priced {
        if mixed.contains(&(p.new_source, p.group.clone())) && p.timing == runs::Timing::Step {
            let kind = if p.new_source {
                "new sources, held out, steady-step figures only"
            } else {
                "steady-step figures only"
            };
            groups
                .entry((p.new_source, p.group.clone(), kind))
                .or_default()
                .push(p.ratio);
        }
    }
    println!("| group | runs | geometric mean | within ±15 % | within ±20 % | range |");
    println!("|---|---:|---:|---:|---:|---|");
    for ((_, group, kind), ratios) in &groups {
        let within = |band: f64| {
            ratios
                .iter()
                .filter(|r| (r.ln()).abs() <= band.ln())
                .count()
        };
        let lo = ratios.iter().cloned().fold(f64::INFINITY, f64::min);
        let hi = ratios.iter().cloned().fold(0.0, f64::max);
        println!(
            "| {group}, {kind} | {} | {:.3} | {} of {} | {} of {} | {lo:.2} … {hi:.2} |",
            ratios.len(),
            geometric_mean(ratios.iter().copied()),
            within(1.15),
            ratios.len(),
            within(1.2),
            ratios.len()
        );
    }
}

/// The table of runs that published their memory, beside the predicted peak (none if no run
/// did).
fn print_memory(priced: &[(&PublishedRun, Priced)]) {
    let with_memory: Vec<&(&PublishedRun, Priced)> = priced
        .iter()
        .filter(|(_, p)| p.published_memory_gib.is_some())
        .collect();
    if !with_memory.is_empty() {
        println!();
        println!("| run | role | published peak (GiB) | counted as | predicted (GiB) | predicted / published | plan's peak (GiB) |");
        println!("|---|---|---:|---|---:|---:|---:|");
        for (r, p) in with_memory {
            let m = p.published_memory_gib.unwrap_or(f64::NAN);
            let predicted = p.predicted_memory_gib.unwrap_or(f64::NAN);
            println!(
                "| {} | {} | {m:.1} | {} | {predicted:.1} | {:.2} | {:.1} |",
                r.id,
                match (p.role, &r.memory_priced_on) {
                    (Role::Excluded, Some(gpu)) => format!("memory only, {gpu}'s rates"),
                    (Role::Fit, _) => "fit".into(),
                    (Role::HeldOut, _) => "held out".into(),
                    (Role::Excluded, None) => "excluded".into(),
                },
                p.published_memory.unwrap_or("?"),
                predicted / m,
                p.predicted_peak_gib
            );
        }
    }
}

/// Fit, to the runs marked `fit`, each generation's matmul efficiency and attention scale,
/// the shared half width and the per-parameter pass bytes
/// ([`osdp_core::cost::PARAM_PASS_BYTES`]), minimising the squared log error of predicted over
/// published tokens/s (coordinate descent, golden-section search per coordinate).
fn fit(runs: &[&PublishedRun], layouts: &Path) {
    use osdp_core::cluster::known::{AMPERE, HOPPER};
    let fit: Vec<&PublishedRun> = runs
        .iter()
        .copied()
        .filter(|r| r.role == Role::Fit)
        .collect();
    // [A100 matmul, H100 matmul, A100 attention scale, H100 attention scale, half width]
    let names = [
        "A100 matmul",
        "H100 matmul",
        "A100 attention ×",
        "H100 attention ×",
        "half width",
        "pass bytes",
    ];
    let bounds = [
        (0.3, 1.0),
        (0.2, 1.0),
        (0.3, 1.6),
        (0.3, 2.4),
        (0.0, 1024.0),
        (0.0, 100.0),
    ];
    let mut x = [
        AMPERE.matmul.value,
        HOPPER.matmul.value,
        1.0,
        1.0,
        HOPPER.matmul_half_width.value,
        osdp_core::cost::PARAM_PASS_BYTES,
    ];
    let loss = |x: &[f64; 6]| -> f64 {
        fit.iter()
            .map(|r| {
                let hopper = r.gpu.contains("H100");
                let (gen, mm, att) = if hopper {
                    (&HOPPER, x[1], x[3])
                } else {
                    (&AMPERE, x[0], x[2])
                };
                let fig = |value: f64| {
                    Some(Figure {
                        value,
                        source: "fit".into(),
                    })
                };
                let adjust = |l: &mut Layout| {
                    let e = &mut l.device.efficiency;
                    e.matmul = fig(mm);
                    e.attention_forward = fig((gen.attention_forward.value * att).min(1.0));
                    e.attention_backward = fig((gen.attention_backward.value * att).min(1.0));
                    e.matmul_half_width = fig(x[4].max(1e-9));
                };
                price_run_tuned(r, layouts, &adjust, &|m| m.param_pass_bytes = x[5])
                    .map_or(0.0, |p| p.ratio.ln().powi(2))
            })
            .sum()
    };
    let g = (5f64.sqrt() - 1.0) / 2.0;
    for _round in 0..4 {
        for i in 0..6 {
            let (mut a, mut b) = bounds[i];
            for _ in 0..30 {
                let (c, d) = (b - g * (b - a), a + g * (b - a));
                let (mut xc, mut xd) = (x, x);
                xc[i] = c;
                xd[i] = d;
                if loss(&xc) < loss(&xd) {
                    b = d;
                } else {
                    a = c;
                }
            }
            x[i] = (a + b) / 2.0;
        }
    }
    println!(
        "fitted on {} runs: rms log error {:.3}",
        fit.len(),
        (loss(&x) / fit.len() as f64).sqrt()
    );
    for (name, v) in names.iter().zip(x) {
        println!("  {name:<18} {v:.3}");
    }
    println!();
}

/// Time per op kind of one run's predicted step.
fn breakdown(r: &PublishedRun, layouts: &Path) {
    let Ok(p) = price_run(r, layouts, &|_| {}) else {
        return;
    };
    let Ok(model) = runs::model_of(r) else {
        return;
    };
    let mut by: BTreeMap<&str, f64> = BTreeMap::new();
    for (op, f) in model.ops.iter().zip(&p.prediction.ops) {
        *by.entry(op.kind.as_str()).or_default() += f.time_s;
    }
    let step = p.prediction.step_time_s;
    for (k, t) in by {
        println!("{k:<16} {:>9.4} s {:>5.1} %", t, 100.0 * t / step);
    }
    let f = &p.prediction;
    println!(
        "compute {:.4} s (of which recompute {:.4} s), exposed communication {:.4} s, optimizer {:.4} s, step overhead {:.4} s",
        f.compute_s, f.recompute_s, f.exposed_comm_s, f.optimizer_s, f.step_overhead_s
    );
    println!("step {step:.4} s, ratio {:.2}", p.ratio);
    let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
    println!(
        "peak {:.2} GiB: persistent {:.2}, activations {:.2}, largest transient {:.2}, \
         side streams' cache {:.2}, runtime overhead {:.2}",
        gib(f.peak_memory_bytes),
        gib(f.persistent_bytes),
        gib(f.activation_bytes),
        gib(f.max_transient_bytes),
        gib(f.side_pool_bytes),
        gib(f.overhead_bytes)
    );
}

/// DLRover/ATorch's Llama-2-7B FSDP table (README at commit 70df7d5): peak
/// `torch.cuda.max_memory_allocated` in MiB on 8, 16, 32 and 64 A100-80GB, FULL_SHARD, every
/// decoder layer checkpointed, 4 × 4,096 tokens per GPU, against the nearest plan priced two
/// ways: this project's precision (bf16 compute copies, fp32 master) and that run's (fp32
/// parameters and gradients, activations priced in fp32 as an upper bound on autocast's mix).
/// `llama`: a priced Llama-2-7B run of the data file, whose shape and GPU it reuses.
fn peaks(llama: &PublishedRun, layouts: &Path) {
    use osdp_core::cost::Precision;
    let fp32_params = Precision {
        name: "fp32 parameters, bf16 autocast",
        param_bytes: 4,
        grad_bytes: 4,
        optimizer_bytes: 8,
        activation_bytes: 4,
    };
    let mib = |b: u64| b as f64 / f64::from(1u32 << 20);
    println!("| GPUs | published MiB | priced as | predicted allocated MiB | of which not states | ratio |");
    println!("|---:|---:|---|---:|---:|---:|");
    for (nodes, published) in [
        (1u32, 39_596.3),
        (2, 34_776.7),
        (4, 32_366.8),
        (8, 31_161.9),
    ] {
        let run = PublishedRun {
            id: format!("dlrover-llama2-7b-g{}", nodes * 8),
            nodes: Some(nodes),
            gpus_per_node: Some(8),
            seq_len: 4096,
            micro_batch: 4,
            grad_accum: Some(1),
            sharding: Some("FULL_SHARD".into()),
            activation_checkpointing: "full".into(),
            recompute_every: None,
            recompute_fraction: None,
            reduce_dtype: Some("fp32".into()),
            network_gb_per_s_per_node: None,
            band: None,
            // Hugging Face's LlamaForCausalLM, as the Colossal-AI run: its eager modules,
            // and its loss's three fp32 logit-sized tensors (that run's stack notes the code).
            stack: Some(runs::Stack {
                framework: "ATorch FSDP on Hugging Face LlamaForCausalLM".into(),
                era: "2023".into(),
                fused_attention: true,
                loss_fp32_logit_copies: 3,
                eager_modules: true,
                ..Default::default()
            }),
            ..llama.clone()
        };
        for precision in [None, Some(fp32_params)] {
            let Ok(p) = price_run_tuned(&run, layouts, &|_| {}, &|m| {
                if let Some(pr) = precision {
                    m.precision = pr;
                }
            }) else {
                continue;
            };
            let pr = &p.prediction;
            let allocated = mib(pr.peak_memory_bytes - pr.overhead_bytes);
            println!(
                "| {} | {published:.0} | {} | {allocated:.0} | {:.0} | {:.2} |",
                nodes * 8,
                precision.map_or("bf16 mixed (this project's)", |p| p.name),
                allocated - mib(pr.persistent_bytes),
                allocated / published
            );
        }
    }
}
