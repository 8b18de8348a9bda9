//! Import a Hugging Face `config.json` into a model description.
//!
//! Supported: `GPT2LMHeadModel`; `OPTForCausalLM` (including `word_embed_proj_dim` ≠ hidden and
//! post-norm `do_layer_norm_before: false`); `LlamaForCausalLM`, `MistralForCausalLM`,
//! `Qwen2ForCausalLM`; `BertForMaskedLM`. Fields a config leaves out take the default of the
//! matching `transformers` config class, as `transformers` itself does, so the parameter count
//! equals the library's `num_parameters()`.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::{
    Activation, AttentionImpl, Biases, DType, Family, GraphBuilder, ModelConfig, ModelSpec,
    NormKind, NormPosition, Positional, Problem, MAX_LAYERS,
};

/// Architectures `import-hf` understands (the first entry of `architectures`).
pub const SUPPORTED_ARCHITECTURES: [&str; 6] = [
    "GPT2LMHeadModel",
    "OPTForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "BertForMaskedLM",
];

/// Longest default sequence: configs advertise up to 128k positions, which nobody trains at
/// by default. `--seq-len` overrides.
pub const DEFAULT_MAX_SEQ_LEN: u64 = 8192;

/// Largest width a config may give (hidden, FFN, heads, head size; the widest models have a
/// few tens of thousands), and the longest sequence `--seq-len` may ask for. With these
/// bounds every figure the graph builder multiplies out fits in 64 bits.
pub const MAX_WIDTH: u64 = 1 << 20;
/// Largest vocabulary (real ones reach a few hundred thousand).
pub const MAX_VOCAB: u64 = 1 << 22;
/// Largest position table; only `--seq-len` of it is priced, so it may be longer than
/// [`MAX_WIDTH`] (the model format's own bound on a dimension).
pub const MAX_POSITIONS: u64 = 1 << 31;

/// The bound [`Cfg::uint`] holds a field to.
fn largest(field: &str) -> u64 {
    match field {
        "vocab_size" | "type_vocab_size" => MAX_VOCAB,
        "n_positions" | "max_position_embeddings" => MAX_POSITIONS,
        "n_layer" | "num_hidden_layers" => MAX_LAYERS,
        _ => MAX_WIDTH,
    }
}

/// Largest config.json read: real ones are a few kilobytes, and the whole file becomes a
/// `serde_json::Value` (several times its size in memory).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    /// Unreadable, not a regular file, or too large.
    #[error(transparent)]
    Read(#[from] crate::input::InputError),
    #[error("{}:{line}:{column}: not valid JSON: {message}", path.display())]
    Json {
        path: PathBuf,
        line: usize,
        column: usize,
        message: String,
    },
    #[error("{}: architecture {found:?} is not supported; supported: {}", path.display(), SUPPORTED_ARCHITECTURES.join(", "))]
    Unsupported { path: PathBuf, found: String },
    #[error("{}: field `{field}`: {message}", path.display())]
    Field {
        path: PathBuf,
        field: String,
        message: String,
    },
    #[error("{}: the imported model is not valid: {problem}", path.display())]
    Invalid { path: PathBuf, problem: Problem },
}

/// Choices the config does not make.
#[derive(Debug, Clone, Default)]
pub struct ImportOptions {
    /// Tokens per sample; default: the config's maximum, capped at [`DEFAULT_MAX_SEQ_LEN`].
    pub seq_len: Option<u64>,
    /// Model name; default: the config file's stem.
    pub name: Option<String>,
    /// Replace the number of layers (to study a shallower model of the same shape).
    pub layers: Option<u64>,
    /// Default: flash (what PyTorch's SDPA runs).
    pub attention: Option<AttentionImpl>,
}

/// Read `path` and import it.
pub fn import_file(path: &Path, opts: &ImportOptions) -> Result<ModelSpec, ImportError> {
    let text = crate::input::read_text(path, MAX_CONFIG_BYTES)?;
    import_str(path, &text, opts)
}

/// Import config text; `path` names the source in messages and in the model's `source`.
pub fn import_str(path: &Path, text: &str, opts: &ImportOptions) -> Result<ModelSpec, ImportError> {
    let value: Value = serde_json::from_str(text).map_err(|e| {
        let mut message = e.to_string();
        if let Some(cut) = message.rfind(" at line ") {
            message.truncate(cut);
        }
        ImportError::Json {
            path: path.to_path_buf(),
            line: e.line(),
            column: e.column(),
            message,
        }
    })?;
    let Value::Object(obj) = value else {
        return Err(ImportError::Field {
            path: path.to_path_buf(),
            field: "(top level)".into(),
            message: "a config.json is a JSON object".into(),
        });
    };
    let cfg = Cfg { path, obj: &obj };
    let arch = cfg.architecture()?;
    let name = opts
        .name
        .clone()
        .unwrap_or_else(|| default_name(path, &obj, &arch));
    let source = Some(format!(
        "imported from {} ({arch}) by osdp-tui import-hf",
        path.file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default()
    ));
    let spec = match arch.as_str() {
        "GPT2LMHeadModel" => gpt2(&cfg, opts)?.finish(&name, Family::Gpt2, source),
        "OPTForCausalLM" => opt(&cfg, opts)?.finish(&name, Family::Opt, source),
        "LlamaForCausalLM" | "MistralForCausalLM" | "Qwen2ForCausalLM" => {
            llama(&cfg, opts, &arch)?.finish(&name, Family::Llama, source)
        }
        "BertForMaskedLM" => bert(&cfg, opts)?.finish(&name, Family::Bert, source),
        _ => {
            return Err(ImportError::Unsupported {
                path: path.to_path_buf(),
                found: arch,
            })
        }
    };
    super::validate(&spec).map_err(|problem| ImportError::Invalid {
        path: path.to_path_buf(),
        problem,
    })?;
    Ok(spec)
}

/// Typed access to a config object, with the defaults of its `transformers` class.
struct Cfg<'a> {
    path: &'a Path,
    obj: &'a Map<String, Value>,
}

impl Cfg<'_> {
    fn bad(&self, field: &str, message: impl Into<String>) -> ImportError {
        ImportError::Field {
            path: self.path.to_path_buf(),
            field: field.to_string(),
            message: message.into(),
        }
    }

    /// `architectures[0]`, or the class `model_type` implies.
    fn architecture(&self) -> Result<String, ImportError> {
        if let Some(v) = self.obj.get("architectures") {
            return match v.as_array().and_then(|a| a.first()).and_then(Value::as_str) {
                Some(a) => Ok(a.to_string()),
                None => Err(self.bad(
                    "architectures",
                    format!("expected a list of class names, found {v}"),
                )),
            };
        }
        let by_type = match self.obj.get("model_type").and_then(Value::as_str) {
            Some("gpt2") => "GPT2LMHeadModel",
            Some("opt") => "OPTForCausalLM",
            Some("llama") => "LlamaForCausalLM",
            Some("mistral") => "MistralForCausalLM",
            Some("qwen2") => "Qwen2ForCausalLM",
            Some("bert") => "BertForMaskedLM",
            Some(other) => other,
            None => {
                return Err(self.bad(
                    "architectures",
                    format!(
                        "missing (and no model_type); supported: {}",
                        SUPPORTED_ARCHITECTURES.join(", ")
                    ),
                ))
            }
        };
        Ok(by_type.to_string())
    }

    /// A positive integer field; absent or null → `default` (None: required).
    fn uint(&self, field: &str, default: Option<u64>) -> Result<u64, ImportError> {
        match self.obj.get(field) {
            None | Some(Value::Null) => default.ok_or_else(|| self.bad(field, "missing")),
            Some(v) => match v.as_u64() {
                Some(n) if n > largest(field) => Err(self.bad(
                    field,
                    format!("{n} is too large (at most {})", largest(field)),
                )),
                Some(n) if n > 0 => Ok(n),
                _ => Err(self.bad(field, format!("expected a positive integer, found {v}"))),
            },
        }
    }

    fn opt_uint(&self, field: &str) -> Result<Option<u64>, ImportError> {
        match self.obj.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(_) => self.uint(field, None).map(Some),
        }
    }

    fn float(&self, field: &str, default: f64) -> Result<f64, ImportError> {
        match self.obj.get(field) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_f64()
                .filter(|f| f.is_finite())
                .ok_or_else(|| self.bad(field, format!("expected a number, found {v}"))),
        }
    }

    fn flag(&self, field: &str, default: bool) -> Result<bool, ImportError> {
        match self.obj.get(field) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.bad(field, format!("expected true or false, found {v}"))),
        }
    }

    fn activation(&self, field: &str, default: &str) -> Result<Activation, ImportError> {
        let name = match self.obj.get(field) {
            None | Some(Value::Null) => default.to_string(),
            Some(Value::String(s)) => s.clone(),
            Some(v) => {
                return Err(self.bad(field, format!("expected an activation name, found {v}")))
            }
        };
        match name.as_str() {
            "gelu" => Ok(Activation::Gelu),
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Ok(Activation::GeluTanh),
            "relu" => Ok(Activation::Relu),
            "silu" | "swish" => Ok(Activation::Silu),
            other => Err(self.bad(
                field,
                format!("activation {other:?} is not supported (gelu, gelu_new, gelu_pytorch_tanh, relu, silu)"),
            )),
        }
    }

    fn seq_len(&self, opts: &ImportOptions, max_positions: u64) -> Result<u64, ImportError> {
        match opts.seq_len {
            Some(0) => Err(self.bad("--seq-len", "must be at least 1")),
            Some(s) if s > MAX_WIDTH => Err(self.bad(
                "--seq-len",
                format!("{s} tokens are too many (at most {MAX_WIDTH})"),
            )),
            Some(s) if s > max_positions => Err(self.bad(
                "--seq-len",
                format!("{s} is longer than the model's {max_positions} positions"),
            )),
            Some(s) => Ok(s),
            None => Ok(max_positions.min(DEFAULT_MAX_SEQ_LEN)),
        }
    }

    fn layers(&self, opts: &ImportOptions, field: &str, default: u64) -> Result<u64, ImportError> {
        let n = self.uint(field, Some(default))?;
        match opts.layers {
            Some(0) => Err(self.bad("--layers", "must be at least 1")),
            Some(l) if l > MAX_LAYERS => Err(self.bad(
                "--layers",
                format!("{l} layers are too many (at most {MAX_LAYERS})"),
            )),
            Some(l) => Ok(l),
            None => Ok(n),
        }
    }

    fn heads_divide(&self, hidden: u64, heads: u64, field: &str) -> Result<u64, ImportError> {
        if hidden % heads != 0 {
            return Err(self.bad(
                field,
                format!("{heads} heads do not divide hidden size {hidden}"),
            ));
        }
        Ok(hidden / heads)
    }
}

struct Common {
    vocab: u64,
    hidden: u64,
    layers: u64,
    heads: u64,
    max_positions: u64,
}

/// A model's name when `--name` is not given: the config's own (`_name_or_path`'s last part,
/// `meta-llama/Llama-2-7b-hf` → `Llama-2-7b-hf`), else the file's stem unless it is the usual
/// `config`, else its directory's name, else the architecture (`LlamaForCausalLM` → `llama`).
fn default_name(path: &Path, obj: &Map<String, Value>, arch: &str) -> String {
    let own = obj
        .get("_name_or_path")
        .and_then(Value::as_str)
        .and_then(|n| n.trim_end_matches('/').rsplit('/').next())
        .filter(|n| !n.trim().is_empty());
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .filter(|s| s != "config" && !s.is_empty());
    let dir = path
        .parent()
        .and_then(|d| d.file_name())
        .map(|d| d.to_string_lossy().into_owned())
        .filter(|d| !d.is_empty() && d != "." && d != "..");
    own.map(str::to_owned).or(stem).or(dir).unwrap_or_else(|| {
        arch.trim_end_matches("ForCausalLM")
            .trim_end_matches("LMHeadModel")
            .trim_end_matches("ForMaskedLM")
            .to_lowercase()
    })
}

fn base_config(c: &Common, seq_len: u64, opts: &ImportOptions) -> ModelConfig {
    ModelConfig {
        vocab_size: c.vocab,
        seq_len,
        max_positions: c.max_positions,
        hidden: c.hidden,
        embed_dim: c.hidden,
        layers: c.layers,
        heads: c.heads,
        kv_heads: c.heads,
        head_dim: c.hidden / c.heads,
        ffn_hidden: 4 * c.hidden,
        norm: NormKind::LayerNorm,
        norm_eps: 1e-5,
        norm_position: NormPosition::Pre,
        final_norm: true,
        activation: Activation::Gelu,
        gated_mlp: false,
        tied_embeddings: true,
        bias: Biases {
            qkv: true,
            attn_out: true,
            mlp: true,
            norm: true,
            lm_head: false,
        },
        positional: Positional::Learned,
        position_offset: 0,
        rope_theta: None,
        type_vocab_size: 0,
        causal: true,
        dropout: 0.0,
        attention_dropout: 0.0,
        attention: opts.attention.unwrap_or(AttentionImpl::Flash),
        dtype: DType::Bf16,
    }
}

fn gpt2(cfg: &Cfg, opts: &ImportOptions) -> Result<GraphBuilder, ImportError> {
    let common = Common {
        vocab: cfg.uint("vocab_size", Some(50257))?,
        hidden: cfg.uint("n_embd", Some(768))?,
        layers: cfg.layers(opts, "n_layer", 12)?,
        heads: cfg.uint("n_head", Some(12))?,
        max_positions: cfg.uint("n_positions", Some(1024))?,
    };
    cfg.heads_divide(common.hidden, common.heads, "n_head")?;
    let mut c = base_config(&common, cfg.seq_len(opts, common.max_positions)?, opts);
    c.ffn_hidden = cfg.opt_uint("n_inner")?.unwrap_or(4 * common.hidden);
    c.norm_eps = cfg.float("layer_norm_epsilon", 1e-5)?;
    c.activation = cfg.activation("activation_function", "gelu_new")?;
    c.tied_embeddings = cfg.flag("tie_word_embeddings", true)?;
    c.dropout = cfg.float("resid_pdrop", 0.1)?;
    c.attention_dropout = cfg.float("attn_pdrop", 0.1)?;
    let (h, v, f, p) = (c.hidden, c.vocab_size, c.ffn_hidden, c.max_positions);
    let tied = c.tied_embeddings;
    let mut g = GraphBuilder::new(c);
    g.embedding("wte", "transformer.wte", v, h);
    g.positional("wpe", "transformer.wpe", p, h);
    let mut x = g.add("embed", "transformer.drop", &["wte", "wpe"], true);
    for i in 0..common.layers {
        g.set_block(Some(i as u32));
        let (pre, mp) = (format!("h{i}"), format!("transformer.h.{i}"));
        let ln1 = g.norm(
            &format!("{pre}.ln_1"),
            &format!("{mp}.ln_1"),
            &x,
            true,
            false,
        );
        let qkv = g.linear(
            &format!("{pre}.attn.c_attn"),
            &format!("{mp}.attn.c_attn"),
            &ln1,
            3 * h,
            true,
            None,
        );
        let att = g.attention(&format!("{pre}.attn.core"), &format!("{mp}.attn"), &[&qkv]);
        let proj = g.linear(
            &format!("{pre}.attn.c_proj"),
            &format!("{mp}.attn.c_proj"),
            &att,
            h,
            true,
            None,
        );
        let r1 = g.add(
            &format!("{pre}.add_1"),
            &format!("{mp}.attn.resid_dropout"),
            &[&x, &proj],
            true,
        );
        let ln2 = g.norm(
            &format!("{pre}.ln_2"),
            &format!("{mp}.ln_2"),
            &r1,
            true,
            false,
        );
        let fc = g.linear(
            &format!("{pre}.mlp.c_fc"),
            &format!("{mp}.mlp.c_fc"),
            &ln2,
            f,
            true,
            None,
        );
        let act = g.activation(&format!("{pre}.mlp.act"), &format!("{mp}.mlp.act"), &[&fc]);
        let out = g.linear(
            &format!("{pre}.mlp.c_proj"),
            &format!("{mp}.mlp.c_proj"),
            &act,
            h,
            true,
            None,
        );
        x = g.add(
            &format!("{pre}.add_2"),
            &format!("{mp}.mlp.dropout"),
            &[&r1, &out],
            true,
        );
    }
    g.set_block(None);
    let lnf = g.norm("ln_f", "transformer.ln_f", &x, true, false);
    let logits = g.linear(
        "lm_head",
        "lm_head",
        &lnf,
        v,
        false,
        tied.then_some("wte.weight"),
    );
    g.cross_entropy("loss", "loss", &logits);
    Ok(g)
}

fn opt(cfg: &Cfg, opts: &ImportOptions) -> Result<GraphBuilder, ImportError> {
    let common = Common {
        vocab: cfg.uint("vocab_size", Some(50272))?,
        hidden: cfg.uint("hidden_size", Some(768))?,
        layers: cfg.layers(opts, "num_hidden_layers", 12)?,
        heads: cfg.uint("num_attention_heads", Some(12))?,
        max_positions: cfg.uint("max_position_embeddings", Some(2048))?,
    };
    cfg.heads_divide(common.hidden, common.heads, "num_attention_heads")?;
    let mut c = base_config(&common, cfg.seq_len(opts, common.max_positions)?, opts);
    let pre_norm = cfg.flag("do_layer_norm_before", true)?;
    let affine = cfg.flag("layer_norm_elementwise_affine", true)?;
    let bias = cfg.flag("enable_bias", true)?;
    c.embed_dim = cfg
        .opt_uint("word_embed_proj_dim")?
        .unwrap_or(common.hidden);
    c.ffn_hidden = cfg.uint("ffn_dim", Some(3072))?;
    c.activation = cfg.activation("activation_function", "relu")?;
    c.norm_position = if pre_norm {
        NormPosition::Pre
    } else {
        NormPosition::Post
    };
    c.final_norm = pre_norm && !cfg.flag("_remove_final_layer_norm", false)?;
    c.tied_embeddings = cfg.flag("tie_word_embeddings", true)?;
    c.bias = Biases {
        qkv: bias,
        attn_out: bias,
        mlp: bias,
        norm: affine,
        lm_head: false,
    };
    c.position_offset = 2;
    c.dropout = cfg.float("dropout", 0.1)?;
    c.attention_dropout = cfg.float("attention_dropout", 0.0)?;
    let (h, e, v, f, p) = (
        c.hidden,
        c.embed_dim,
        c.vocab_size,
        c.ffn_hidden,
        c.max_positions,
    );
    let tied = c.tied_embeddings;
    let mut g = GraphBuilder::new(c);
    let mut tok = g.embedding("embed_tokens", "model.decoder.embed_tokens", v, e);
    if e != h {
        tok = g.linear(
            "project_in",
            "model.decoder.project_in",
            &tok,
            h,
            false,
            None,
        );
    }
    g.positional("embed_positions", "model.decoder.embed_positions", p + 2, h);
    let mut x = g.add(
        "embed",
        "model.decoder.dropout",
        &[&tok, "embed_positions"],
        true,
    );
    for i in 0..common.layers {
        g.set_block(Some(i as u32));
        let (pre, mp) = (format!("layers{i}"), format!("model.decoder.layers.{i}"));
        let ln_a = (
            format!("{pre}.self_attn_layer_norm"),
            format!("{mp}.self_attn_layer_norm"),
        );
        let ln_f = (
            format!("{pre}.final_layer_norm"),
            format!("{mp}.final_layer_norm"),
        );
        let attn_in = if pre_norm {
            g.norm(&ln_a.0, &ln_a.1, &x, affine, false)
        } else {
            x.clone()
        };
        let q = g.linear(
            &format!("{pre}.self_attn.q_proj"),
            &format!("{mp}.self_attn.q_proj"),
            &attn_in,
            h,
            bias,
            None,
        );
        let k = g.linear(
            &format!("{pre}.self_attn.k_proj"),
            &format!("{mp}.self_attn.k_proj"),
            &attn_in,
            h,
            bias,
            None,
        );
        let vv = g.linear(
            &format!("{pre}.self_attn.v_proj"),
            &format!("{mp}.self_attn.v_proj"),
            &attn_in,
            h,
            bias,
            None,
        );
        let att = g.attention(
            &format!("{pre}.self_attn.core"),
            &format!("{mp}.self_attn"),
            &[&q, &k, &vv],
        );
        let o = g.linear(
            &format!("{pre}.self_attn.out_proj"),
            &format!("{mp}.self_attn.out_proj"),
            &att,
            h,
            bias,
            None,
        );
        let mut r1 = g.add(
            &format!("{pre}.add_1"),
            &format!("{mp}.dropout_1"),
            &[&x, &o],
            true,
        );
        if !pre_norm {
            r1 = g.norm(&ln_a.0, &ln_a.1, &r1, affine, false);
        }
        let mlp_in = if pre_norm {
            g.norm(&ln_f.0, &ln_f.1, &r1, affine, false)
        } else {
            r1.clone()
        };
        let fc1 = g.linear(
            &format!("{pre}.fc1"),
            &format!("{mp}.fc1"),
            &mlp_in,
            f,
            bias,
            None,
        );
        let act = g.activation(
            &format!("{pre}.act"),
            &format!("{mp}.activation_fn"),
            &[&fc1],
        );
        let fc2 = g.linear(
            &format!("{pre}.fc2"),
            &format!("{mp}.fc2"),
            &act,
            h,
            bias,
            None,
        );
        x = g.add(
            &format!("{pre}.add_2"),
            &format!("{mp}.dropout_2"),
            &[&r1, &fc2],
            true,
        );
        if !pre_norm {
            x = g.norm(&ln_f.0, &ln_f.1, &x, affine, false);
        }
    }
    g.set_block(None);
    if g.config().final_norm {
        x = g.norm(
            "final_layer_norm",
            "model.decoder.final_layer_norm",
            &x,
            affine,
            false,
        );
    }
    if e != h {
        x = g.linear(
            "project_out",
            "model.decoder.project_out",
            &x,
            e,
            false,
            None,
        );
    }
    let logits = g.linear(
        "lm_head",
        "lm_head",
        &x,
        v,
        false,
        tied.then_some("embed_tokens.weight"),
    );
    g.cross_entropy("loss", "loss", &logits);
    Ok(g)
}

fn llama(cfg: &Cfg, opts: &ImportOptions, arch: &str) -> Result<GraphBuilder, ImportError> {
    // Defaults of LlamaConfig, MistralConfig and Qwen2Config respectively.
    let (vocab, ffn, kv, max_pos) = match arch {
        "MistralForCausalLM" => (32000, 14336, 8, 4096 * 32),
        "Qwen2ForCausalLM" => (151936, 22016, 32, 32768),
        _ => (32000, 11008, 32, 2048),
    };
    let common = Common {
        vocab: cfg.uint("vocab_size", Some(vocab))?,
        hidden: cfg.uint("hidden_size", Some(4096))?,
        layers: cfg.layers(opts, "num_hidden_layers", 32)?,
        heads: cfg.uint("num_attention_heads", Some(32))?,
        max_positions: cfg.uint("max_position_embeddings", Some(max_pos))?,
    };
    let mut c = base_config(&common, cfg.seq_len(opts, common.max_positions)?, opts);
    let default_kv = if arch == "LlamaForCausalLM" {
        common.heads
    } else {
        kv
    };
    c.kv_heads = cfg.uint("num_key_value_heads", Some(default_kv))?;
    c.head_dim = match cfg.opt_uint("head_dim")? {
        Some(d) => d,
        None => cfg.heads_divide(common.hidden, common.heads, "num_attention_heads")?,
    };
    // An explicit head_dim makes the attention width heads × head_dim, not hidden.
    if c.heads * c.head_dim > MAX_WIDTH {
        return Err(cfg.bad(
            "head_dim",
            format!(
                "{} heads of {} make attention {} wide (at most {MAX_WIDTH})",
                c.heads,
                c.head_dim,
                c.heads * c.head_dim
            ),
        ));
    }
    if c.heads % c.kv_heads != 0 {
        return Err(cfg.bad(
            "num_key_value_heads",
            format!(
                "{} query heads cannot be grouped over {} key/value heads",
                c.heads, c.kv_heads
            ),
        ));
    }
    c.ffn_hidden = cfg.uint("intermediate_size", Some(ffn))?;
    c.norm = NormKind::RmsNorm;
    c.norm_eps = cfg.float("rms_norm_eps", 1e-6)?;
    c.activation = cfg.activation("hidden_act", "silu")?;
    c.gated_mlp = true;
    c.tied_embeddings = cfg.flag("tie_word_embeddings", false)?;
    let (qkv_bias, o_bias, mlp_bias) = match arch {
        "Qwen2ForCausalLM" => (true, false, false),
        "MistralForCausalLM" => (false, false, false),
        _ => {
            let ab = cfg.flag("attention_bias", false)?;
            (ab, ab, cfg.flag("mlp_bias", false)?)
        }
    };
    c.bias = Biases {
        qkv: qkv_bias,
        attn_out: o_bias,
        mlp: mlp_bias,
        norm: false,
        lm_head: false,
    };
    c.positional = Positional::Rotary;
    c.rope_theta = Some(cfg.float("rope_theta", 10000.0)?);
    c.attention_dropout = cfg.float("attention_dropout", 0.0)?;
    let (h, v, f) = (c.hidden, c.vocab_size, c.ffn_hidden);
    let (qd, kvd) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
    let tied = c.tied_embeddings;
    let mut g = GraphBuilder::new(c);
    let mut x = g.embedding("embed_tokens", "model.embed_tokens", v, h);
    for i in 0..common.layers {
        g.set_block(Some(i as u32));
        let (pre, mp) = (format!("layers{i}"), format!("model.layers.{i}"));
        let n1 = g.norm(
            &format!("{pre}.input_layernorm"),
            &format!("{mp}.input_layernorm"),
            &x,
            true,
            false,
        );
        let q = g.linear(
            &format!("{pre}.self_attn.q_proj"),
            &format!("{mp}.self_attn.q_proj"),
            &n1,
            qd,
            qkv_bias,
            None,
        );
        let k = g.linear(
            &format!("{pre}.self_attn.k_proj"),
            &format!("{mp}.self_attn.k_proj"),
            &n1,
            kvd,
            qkv_bias,
            None,
        );
        let vv = g.linear(
            &format!("{pre}.self_attn.v_proj"),
            &format!("{mp}.self_attn.v_proj"),
            &n1,
            kvd,
            qkv_bias,
            None,
        );
        let att = g.attention(
            &format!("{pre}.self_attn.core"),
            &format!("{mp}.self_attn"),
            &[&q, &k, &vv],
        );
        let o = g.linear(
            &format!("{pre}.self_attn.o_proj"),
            &format!("{mp}.self_attn.o_proj"),
            &att,
            h,
            o_bias,
            None,
        );
        let r1 = g.add(
            &format!("{pre}.add_1"),
            &format!("{mp}.residual_1"),
            &[&x, &o],
            false,
        );
        let n2 = g.norm(
            &format!("{pre}.post_attention_layernorm"),
            &format!("{mp}.post_attention_layernorm"),
            &r1,
            true,
            false,
        );
        let gate = g.linear(
            &format!("{pre}.mlp.gate_proj"),
            &format!("{mp}.mlp.gate_proj"),
            &n2,
            f,
            mlp_bias,
            None,
        );
        let up = g.linear(
            &format!("{pre}.mlp.up_proj"),
            &format!("{mp}.mlp.up_proj"),
            &n2,
            f,
            mlp_bias,
            None,
        );
        let act = g.activation(
            &format!("{pre}.mlp.act"),
            &format!("{mp}.mlp.act_fn"),
            &[&gate, &up],
        );
        let down = g.linear(
            &format!("{pre}.mlp.down_proj"),
            &format!("{mp}.mlp.down_proj"),
            &act,
            h,
            mlp_bias,
            None,
        );
        x = g.add(
            &format!("{pre}.add_2"),
            &format!("{mp}.residual_2"),
            &[&r1, &down],
            false,
        );
    }
    g.set_block(None);
    let n = g.norm("norm", "model.norm", &x, true, false);
    let logits = g.linear(
        "lm_head",
        "lm_head",
        &n,
        v,
        false,
        tied.then_some("embed_tokens.weight"),
    );
    g.cross_entropy("loss", "loss", &logits);
    Ok(g)
}

fn bert(cfg: &Cfg, opts: &ImportOptions) -> Result<GraphBuilder, ImportError> {
    let common = Common {
        vocab: cfg.uint("vocab_size", Some(30522))?,
        hidden: cfg.uint("hidden_size", Some(768))?,
        layers: cfg.layers(opts, "num_hidden_layers", 12)?,
        heads: cfg.uint("num_attention_heads", Some(12))?,
        max_positions: cfg.uint("max_position_embeddings", Some(512))?,
    };
    cfg.heads_divide(common.hidden, common.heads, "num_attention_heads")?;
    let mut c = base_config(&common, cfg.seq_len(opts, common.max_positions)?, opts);
    c.ffn_hidden = cfg.uint("intermediate_size", Some(3072))?;
    c.norm_eps = cfg.float("layer_norm_eps", 1e-12)?;
    c.norm_position = NormPosition::Post;
    c.final_norm = false;
    c.activation = cfg.activation("hidden_act", "gelu")?;
    c.tied_embeddings = cfg.flag("tie_word_embeddings", true)?;
    c.bias.lm_head = true;
    c.type_vocab_size = cfg.uint("type_vocab_size", Some(2))?;
    c.causal = false;
    c.dropout = cfg.float("hidden_dropout_prob", 0.1)?;
    c.attention_dropout = cfg.float("attention_probs_dropout_prob", 0.1)?;
    let (h, v, f, p, t) = (
        c.hidden,
        c.vocab_size,
        c.ffn_hidden,
        c.max_positions,
        c.type_vocab_size,
    );
    let tied = c.tied_embeddings;
    let mut g = GraphBuilder::new(c);
    g.embedding("word_embeddings", "bert.embeddings.word_embeddings", v, h);
    g.positional(
        "position_embeddings",
        "bert.embeddings.position_embeddings",
        p,
        h,
    );
    g.embedding(
        "token_type_embeddings",
        "bert.embeddings.token_type_embeddings",
        t,
        h,
    );
    let sum = g.add(
        "embed",
        "bert.embeddings",
        &[
            "word_embeddings",
            "position_embeddings",
            "token_type_embeddings",
        ],
        false,
    );
    let mut x = g.norm("embed_ln", "bert.embeddings.LayerNorm", &sum, true, true);
    for i in 0..common.layers {
        g.set_block(Some(i as u32));
        let (pre, mp) = (format!("layer{i}"), format!("bert.encoder.layer.{i}"));
        let q = g.linear(
            &format!("{pre}.attention.query"),
            &format!("{mp}.attention.self.query"),
            &x,
            h,
            true,
            None,
        );
        let k = g.linear(
            &format!("{pre}.attention.key"),
            &format!("{mp}.attention.self.key"),
            &x,
            h,
            true,
            None,
        );
        let vv = g.linear(
            &format!("{pre}.attention.value"),
            &format!("{mp}.attention.self.value"),
            &x,
            h,
            true,
            None,
        );
        let att = g.attention(
            &format!("{pre}.attention.core"),
            &format!("{mp}.attention.self"),
            &[&q, &k, &vv],
        );
        let o = g.linear(
            &format!("{pre}.attention.output"),
            &format!("{mp}.attention.output.dense"),
            &att,
            h,
            true,
            None,
        );
        let r1 = g.add(
            &format!("{pre}.add_1"),
            &format!("{mp}.attention.output.dropout"),
            &[&x, &o],
            true,
        );
        let n1 = g.norm(
            &format!("{pre}.attention.ln"),
            &format!("{mp}.attention.output.LayerNorm"),
            &r1,
            true,
            false,
        );
        let inter = g.linear(
            &format!("{pre}.intermediate"),
            &format!("{mp}.intermediate.dense"),
            &n1,
            f,
            true,
            None,
        );
        let act = g.activation(
            &format!("{pre}.act"),
            &format!("{mp}.intermediate.intermediate_act_fn"),
            &[&inter],
        );
        let out = g.linear(
            &format!("{pre}.output"),
            &format!("{mp}.output.dense"),
            &act,
            h,
            true,
            None,
        );
        let r2 = g.add(
            &format!("{pre}.add_2"),
            &format!("{mp}.output.dropout"),
            &[&n1, &out],
            true,
        );
        x = g.norm(
            &format!("{pre}.output.ln"),
            &format!("{mp}.output.LayerNorm"),
            &r2,
            true,
            false,
        );
    }
    g.set_block(None);
    let d = g.linear(
        "cls.transform",
        "cls.predictions.transform.dense",
        &x,
        h,
        true,
        None,
    );
    let a = g.activation(
        "cls.act",
        "cls.predictions.transform.transform_act_fn",
        &[&d],
    );
    let n = g.norm(
        "cls.ln",
        "cls.predictions.transform.LayerNorm",
        &a,
        true,
        false,
    );
    let logits = g.linear(
        "cls.decoder",
        "cls.predictions.decoder",
        &n,
        v,
        true,
        tied.then_some("word_embeddings.weight"),
    );
    g.cross_entropy("loss", "loss", &logits);
    Ok(g)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPT2_SMALL: &str = r#"{"architectures": ["GPT2LMHeadModel"], "n_embd": 768, "n_layer": 2,
        "n_head": 12, "n_positions": 1024, "vocab_size": 50257, "resid_pdrop": 0.1,
        "attn_pdrop": 0.1, "embd_pdrop": 0.1}"#;

    fn import(text: &str, attention: AttentionImpl) -> ModelSpec {
        let opts = ImportOptions {
            attention: Some(attention),
            ..Default::default()
        };
        import_str(Path::new("config.json"), text, &opts).expect("imports")
    }

    fn block_saved(m: &ModelSpec, block: u32) -> u64 {
        m.ops
            .iter()
            .filter(|o| o.block == Some(block))
            .map(|o| o.saved_bytes_per_sample)
            .sum()
    }

    #[test]
    fn eager_gpt_block_keeps_korthikanti_activation_bytes() {
        // Korthikanti et al. 2022, eq. (1): a GPT block with 16-bit activations and dropout keeps
        // s·b·h·(34 + 5·a·s/h) bytes; here b = 1 sample.
        let m = import(GPT2_SMALL, AttentionImpl::Eager);
        let (s, h, a) = (1024u64, 768u64, 12u64);
        assert_eq!(block_saved(&m, 0), 34 * s * h + 5 * a * s * s);
        assert_eq!(block_saved(&m, 1), block_saved(&m, 0));
    }

    #[test]
    fn flash_attention_drops_the_quadratic_term() {
        let m = import(GPT2_SMALL, AttentionImpl::Flash);
        let (s, h, a) = (1024u64, 768u64, 12u64);
        // No s² probabilities or dropout mask; the kernel keeps a fp32 log-sum-exp per row.
        assert_eq!(block_saved(&m, 0), 34 * s * h + 4 * a * s);
    }

    #[test]
    fn grouped_query_llama_block_counts_shared_inputs_once() {
        let text = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 256,
            "intermediate_size": 688, "num_hidden_layers": 1, "num_attention_heads": 8,
            "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 64}"#;
        let m = import(text, AttentionImpl::Flash);
        let (s, h, f, heads, kv) = (64u64, 256u64, 688u64, 8u64, 64u64);
        // norm in, q/k/v in (once), q, k, v, output + lse, post-norm in, gate/up in (once),
        // gate and up outputs, down in; all bf16.
        let want = 2 * s * h
            + 2 * s * h
            + 2 * s * (h + 2 * kv)
            + 2 * s * h
            + heads * s * 4
            + 2 * s * h
            + 2 * s * h
            + 2 * 2 * s * f
            + 2 * s * f;
        assert_eq!(block_saved(&m, 0), want);
        let k = m
            .ops
            .iter()
            .find(|o| o.id == "layers0.self_attn.k_proj")
            .unwrap();
        assert_eq!(k.params[0].shape, vec![kv as i64, h as i64]);
    }

    #[test]
    fn linear_flops_are_two_per_multiply_add() {
        let m = import(GPT2_SMALL, AttentionImpl::Flash);
        let fc = m.ops.iter().find(|o| o.id == "h0.mlp.c_fc").unwrap();
        assert_eq!(fc.fwd_flops_per_sample, 2 * 1024 * 768 * 3072);
        let att = m.ops.iter().find(|o| o.id == "h0.attn.core").unwrap();
        assert_eq!(att.fwd_flops_per_sample, 4 * 1024 * 1024 * 768);
    }

    #[test]
    fn unknown_activation_names_the_field() {
        let text = r#"{"architectures": ["GPT2LMHeadModel"], "activation_function": "mish"}"#;
        let err = import_str(Path::new("c.json"), text, &ImportOptions::default()).unwrap_err();
        assert!(
            err.to_string()
                .contains("field `activation_function`: activation \"mish\""),
            "{err}"
        );
    }

    #[test]
    fn model_type_stands_in_for_architectures() {
        let text = r#"{"model_type": "opt", "hidden_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "ffn_dim": 256, "vocab_size": 100, "max_position_embeddings": 32}"#;
        let m = import_str(Path::new("c.json"), text, &ImportOptions::default()).unwrap();
        assert_eq!(m.family, Family::Opt);
        // OPT's position table is offset by 2 rows.
        let pos = m.ops.iter().find(|o| o.id == "embed_positions").unwrap();
        assert_eq!(pos.params[0].shape, vec![34, 64]);
    }
}
