//! Published training runs, priced: the cost model checked against throughput and memory
//! that other people measured (`docs/published-runs.json`, with a link for every figure).
//!
//! Each run is reproduced as a plan the planner could have chosen — one strategy on every
//! op (FSDP `FULL_SHARD` is ZeRO-3, `SHARD_GRAD_OP` ZeRO-2, `HYBRID_SHARD` hsdp, DDP), full
//! activation checkpointing as recomputation of every block, the run's micro-batch and
//! accumulation — on the layout of its GPUs, and priced by [`osdp_core::plan::evaluate`], the same
//! function `osdp-tui evaluate` uses.

// Shared by the example and tests/it/published.rs, each of which uses part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use osdp_core::cluster::{read_layout, Figure, Layout};
use osdp_core::cost::{Machine, Strategy};
use osdp_core::model::hf::{import_str, ImportOptions};
use osdp_core::model::ModelSpec;
use osdp_core::plan::baseline::Baseline;
use osdp_core::plan::{evaluate, Prediction};

/// The data file: what it is, and the runs.
#[derive(Debug, Clone, Deserialize)]
pub struct RunSet {
    #[serde(default)]
    pub about: String,
    pub runs: Vec<PublishedRun>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Source {
    pub url: String,
    #[serde(default)]
    pub what: String,
    #[serde(default)]
    pub accessed: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
pub struct Interconnect {
    #[serde(default)]
    pub intra: Option<String>,
    #[serde(default)]
    pub inter: Option<String>,
}

/// A model's shape as a run reports it.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Shape {
    /// `mpt`, `gpt2` or `llama`.
    pub family: String,
    pub name: String,
    pub d_model: u64,
    pub n_layers: u64,
    pub n_heads: u64,
    #[serde(default)]
    pub n_kv_heads: Option<u64>,
    #[serde(default)]
    pub ffn_hidden: Option<u64>,
    pub vocab: u64,
    #[serde(default)]
    pub tied_embeddings: Option<bool>,
    #[serde(default)]
    pub gated_mlp: Option<bool>,
    #[serde(default)]
    pub params: Option<f64>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
pub struct Published {
    #[serde(default)]
    pub tokens_per_s_per_gpu: Option<f64>,
    #[serde(default)]
    pub tokens_per_s_total: Option<f64>,
    #[serde(default)]
    pub mfu: Option<f64>,
    #[serde(default)]
    pub memory_reserved_gib: Option<f64>,
    #[serde(default)]
    pub memory_allocated_gib: Option<f64>,
}

/// How a run takes part in the check.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The efficiencies were fitted on it.
    Fit,
    /// Held out: priced with the fitted constants, never used to fit them.
    #[default]
    HeldOut,
    /// Listed for the record, not priced (the doc says why).
    Excluded,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct PublishedRun {
    pub id: String,
    pub source: Source,
    pub gpu: String,
    /// Absent where the source does not say (such runs cannot be priced).
    #[serde(default)]
    pub nodes: Option<u32>,
    #[serde(default)]
    pub gpus_per_node: Option<u32>,
    #[serde(default)]
    pub interconnect: Option<Interconnect>,
    pub model: Shape,
    pub seq_len: u64,
    pub micro_batch: u64,
    #[serde(default)]
    pub grad_accum: Option<u64>,
    #[serde(default)]
    pub global_batch: Option<u64>,
    #[serde(default)]
    pub sharding: Option<String>,
    pub activation_checkpointing: String,
    #[serde(default)]
    pub attention: Option<String>,
    #[serde(default)]
    pub compile: Option<bool>,
    #[serde(default)]
    pub precision: Option<String>,
    /// The network between nodes, all NICs of a node together, as the source states it
    /// (GB/s); absent: the shipped multi-node layout's.
    #[serde(default)]
    pub network_gb_per_s_per_node: Option<f64>,
    /// Selective checkpointing that recomputes every n-th block.
    #[serde(default)]
    pub recompute_every: Option<usize>,
    /// The dtype gradients were reduced in (`fp32`: FSDP's and llm-foundry's default).
    #[serde(default)]
    pub reduce_dtype: Option<String>,
    pub published: Published,
    #[serde(default)]
    pub notes: Option<String>,
    #[serde(default)]
    pub role: Role,
    /// Why a run is excluded.
    #[serde(default)]
    pub excluded_because: Option<String>,
    /// Predicted/published range this run must stay in, where it differs from the default
    /// (the notes say why).
    #[serde(default)]
    pub band: Option<[f64; 2]>,
}

impl PublishedRun {
    pub fn gpus(&self) -> u32 {
        self.nodes.unwrap_or(1) * self.gpus_per_node.unwrap_or(1)
    }

    fn multi_node(&self) -> bool {
        self.nodes.unwrap_or(1) > 1
    }

    /// Published tokens/s per GPU (from the total when only that is given).
    pub fn tokens_per_s_per_gpu(&self) -> Option<f64> {
        self.published.tokens_per_s_per_gpu.or_else(|| {
            self.published
                .tokens_per_s_total
                .map(|t| t / f64::from(self.gpus().max(1)))
        })
    }

    /// `8× A100`, `64× H100 (8 nodes)`: the group a run is reported in.
    pub fn group(&self) -> String {
        let gpu = if self.gpu.contains("H100") {
            "H100"
        } else if self.gpu.contains("A100") {
            "A100"
        } else {
            self.gpu.as_str()
        };
        if self.multi_node() {
            format!("{gpu}, 2+ nodes")
        } else {
            format!("{gpu}, 1 node")
        }
    }
}

/// A run priced.
#[derive(Debug, Clone, Serialize)]
pub struct Priced {
    pub id: String,
    pub group: String,
    pub role: Role,
    pub published_tokens_per_s_per_gpu: f64,
    pub predicted_tokens_per_s_per_gpu: f64,
    /// Predicted over published.
    pub ratio: f64,
    pub published_memory_gib: Option<f64>,
    pub predicted_reserved_gib: f64,
    pub prediction: Prediction,
}

/// Read the data file.
pub fn read_runs(path: &Path) -> Result<RunSet, String> {
    let text = osdp_core::input::read_text(path, 16 << 20).map_err(|e| e.to_string())?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// The Hugging Face config a run's shape corresponds to. MPT (ALiBi, no biases) is priced
/// as a GPT-2-style block of the same widths: a learned position table and biases add well
/// under 1 % of the parameters and nothing measurable to the step.
pub fn hf_config(shape: &Shape, seq_len: u64) -> Result<serde_json::Value, String> {
    let ffn = shape.ffn_hidden.unwrap_or(4 * shape.d_model);
    let tied = shape.tied_embeddings.unwrap_or(shape.family != "llama");
    Ok(match shape.family.as_str() {
        "mpt" | "gpt2" => serde_json::json!({
            "architectures": ["GPT2LMHeadModel"],
            "n_embd": shape.d_model,
            "n_layer": shape.n_layers,
            "n_head": shape.n_heads,
            "n_inner": ffn,
            "n_positions": seq_len,
            "vocab_size": shape.vocab,
            "activation_function": "gelu_new",
            "tie_word_embeddings": tied,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        }),
        "llama" => serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": shape.d_model,
            "num_hidden_layers": shape.n_layers,
            "num_attention_heads": shape.n_heads,
            "num_key_value_heads": shape.n_kv_heads.unwrap_or(shape.n_heads),
            "intermediate_size": ffn,
            "max_position_embeddings": seq_len,
            "vocab_size": shape.vocab,
            "tie_word_embeddings": tied,
            "hidden_act": "silu",
        }),
        other => return Err(format!("model family {other:?} is not priced here")),
    })
}

/// The run's model as a description at its sequence length.
pub fn model_of(run: &PublishedRun) -> Result<ModelSpec, String> {
    let config = hf_config(&run.model, run.seq_len)?;
    let opts = ImportOptions {
        seq_len: Some(run.seq_len),
        name: Some(run.model.name.clone()),
        ..Default::default()
    };
    import_str(
        Path::new(&format!("{}.json", run.model.name)),
        &config.to_string(),
        &opts,
    )
    .map_err(|e| e.to_string())
}

/// The layout file a run's GPUs are described by, under `layouts`.
fn layout_file(run: &PublishedRun) -> Result<&'static str, String> {
    let g = run.gpu.to_uppercase();
    Ok(
        match (g.contains("H100"), g.contains("A100"), run.multi_node()) {
            (true, _, false) => "h100-sxm-8x-nvlink.json",
            (true, _, true) => "h100-sxm-2x8-ib-ndr.json",
            (_, true, false) => "a100-80gb-8x-nvlink.json",
            (_, true, true) => "a100-80gb-2x8-ib-hdr.json",
            _ => return Err(format!("no layout for GPU {:?}", run.gpu)),
        },
    )
}

/// The run's cluster: the shipped layout of its GPUs with its node count, memory size and
/// gradient reduce dtype.
pub fn layout_of(run: &PublishedRun, layouts: &Path) -> Result<Layout, String> {
    let path: PathBuf = layouts.join(layout_file(run)?);
    let mut l = read_layout(&path).map_err(|e| e.to_string())?;
    let (Some(nodes), Some(per_node)) = (run.nodes, run.gpus_per_node) else {
        return Err("the source does not say how many GPUs".into());
    };
    l.nodes = nodes;
    l.gpus_per_node = per_node;
    for (size, gib) in [("40GB", 40.0), ("96GB", 94.0)] {
        if run.gpu.to_uppercase().contains(size) {
            l.device.memory_gib = Figure {
                value: gib,
                source: format!("{} as the run names it", run.gpu),
            };
        }
    }
    // The 40 GB A100 has HBM2, not the 80 GB one's HBM2e: element-wise ops run at its rate.
    if run.gpu.to_uppercase().contains("A100-40GB") {
        l.device.memory_bandwidth_gb_per_s = Figure {
            value: A100_40GB_MEMORY_GB_PER_S,
            source: "NVIDIA A100 datasheet: 1,555 GB/s HBM2 on the 40 GB SXM".into(),
        };
    }
    l.gradient_reduce_dtype = match run.reduce_dtype.as_deref().unwrap_or("fp32") {
        "fp32" => Some(osdp_core::cluster::ReduceDType::Fp32),
        "bf16" => Some(osdp_core::cluster::ReduceDType::Bf16),
        other => return Err(format!("reduce dtype {other:?}")),
    };
    if let (Some(net), Some(inter)) = (run.network_gb_per_s_per_node, l.inter_node.as_mut()) {
        inter.nics_per_node = None;
        inter.bus_bandwidth_gb_per_s = Figure {
            value: net * NCCL_NETWORK_EFFICIENCY,
            source: format!(
                "{net} GB/s per node as the run's source states it, at NCCL's ~92 % of line rate"
            ),
        };
    }
    Ok(l)
}

/// The A100 40 GB SXM's memory bandwidth (NVIDIA A100 datasheet; the 80 GB SXM has 2,039).
const A100_40GB_MEMORY_GB_PER_S: f64 = 1555.0;

/// What NCCL achieves of a network's line rate (46 of 50 GB/s on InfiniBand NDR).
const NCCL_NETWORK_EFFICIENCY: f64 = 0.92;

/// The strategy a run's sharding names.
pub fn strategy_of(sharding: &str) -> Result<Strategy, String> {
    Ok(match sharding.to_uppercase().as_str() {
        "FULL_SHARD" | "ZERO3" => Strategy::Zero3,
        "HYBRID_SHARD" | "HSDP" => Strategy::Hsdp,
        "SHARD_GRAD_OP" | "ZERO2" => Strategy::Zero2,
        "ZERO1" => Strategy::Zero1,
        "NO_SHARD" | "DDP" => Strategy::Dp,
        other => return Err(format!("sharding {other} has no single-strategy plan")),
    })
}

/// Price one run on the layouts under `layouts`, `adjust` changing the layout first (to fit
/// efficiencies).
pub fn price_run(
    run: &PublishedRun,
    layouts: &Path,
    adjust: &dyn Fn(&mut Layout),
) -> Result<Priced, String> {
    price_run_tuned(run, layouts, adjust, &|_| {})
}

/// [`price_run`], `tune` changing the resolved machine too (to fit figures that are not the
/// layout's).
pub fn price_run_tuned(
    run: &PublishedRun,
    layouts: &Path,
    adjust: &dyn Fn(&mut Layout),
    tune: &dyn Fn(&mut Machine),
) -> Result<Priced, String> {
    let published = run
        .tokens_per_s_per_gpu()
        .ok_or_else(|| format!("{}: no published tokens/s", run.id))?;
    let model = model_of(run)?;
    let mut layout = layout_of(run, layouts)?;
    adjust(&mut layout);
    let mut m = Machine::new(&layout, &model);
    tune(&mut m);
    let every = match (run.activation_checkpointing.as_str(), run.recompute_every) {
        ("full", _) => 1,
        ("none", _) => 0,
        ("selective", Some(n)) if n > 0 => n,
        (other, _) => return Err(format!("{}: activation checkpointing {other:?}", run.id)),
    };
    let baseline = Baseline {
        strategy: strategy_of(run.sharding.as_deref().unwrap_or("(not stated)"))?,
        checkpointing: every > 0,
    };
    let mut plan = baseline.plan(&model, run.micro_batch, run.grad_accum.unwrap_or(1).max(1));
    for (b, on) in plan.recompute.iter_mut().enumerate() {
        *on = every > 0 && b % every == 0;
    }
    let p = evaluate(&model, &m, &plan);
    let predicted = p.tokens_per_s / f64::from(m.ranks);
    Ok(Priced {
        id: run.id.clone(),
        group: run.group(),
        role: run.role,
        published_tokens_per_s_per_gpu: published,
        predicted_tokens_per_s_per_gpu: predicted,
        ratio: predicted / published,
        published_memory_gib: run
            .published
            .memory_reserved_gib
            .or(run.published.memory_allocated_gib),
        predicted_reserved_gib: p.peak_memory_bytes as f64 / (1u64 << 30) as f64,
        prediction: p,
    })
}

/// The predicted/published range a run must stay in unless it names its own.
pub const DEFAULT_BAND: [f64; 2] = [0.8, 1.25];

/// Geometric mean of predicted/published.
pub fn geometric_mean(ratios: impl IntoIterator<Item = f64>) -> f64 {
    let (sum, n) = ratios
        .into_iter()
        .fold((0.0, 0usize), |(s, n), r| (s + r.ln(), n + 1));
    if n == 0 {
        f64::NAN
    } else {
        (sum / n as f64).exp()
    }
}
