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
    Activation, AttentionImpl, Biases, ComposedGelu, DType, Family, GraphBuilder, Kernels,
    ModelConfig, ModelSpec, NormKind, NormPosition, Positional, Problem, MAX_LAYERS, MAX_POSITIONS,
    MAX_VOCAB, MAX_WIDTH,
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
    /// Whose kernels the saved bytes assume; default osdp-tui's trainer's.
    pub kernels: Kernels,
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
    let ((config, template), family) = match arch.as_str() {
        "GPT2LMHeadModel" => (gpt2(&cfg, opts)?, Family::Gpt2),
        "OPTForCausalLM" => (opt(&cfg, opts)?, Family::Opt),
        "LlamaForCausalLM" | "MistralForCausalLM" | "Qwen2ForCausalLM" => {
            (llama(&cfg, opts, &arch)?, Family::Llama)
        }
        "BertForMaskedLM" => (bert(&cfg, opts)?, Family::Bert),
        _ => {
            return Err(ImportError::Unsupported {
                path: path.to_path_buf(),
                found: arch,
            })
        }
    };
    let mut spec = template.build(config).finish(&name, family, source);
    spec.hf_config = Some(obj.clone());
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

    /// The activation the config names, and where the model is priced as transformers' eager
    /// code, whether transformers writes it as separate PyTorch ops ([`ComposedGelu`]).
    fn activation(
        &self,
        field: &str,
        default: &str,
        opts: &ImportOptions,
    ) -> Result<(Activation, Option<ComposedGelu>), ImportError> {
        let name = match self.obj.get(field) {
            None | Some(Value::Null) => default.to_string(),
            Some(Value::String(s)) => s.clone(),
            Some(v) => {
                return Err(self.bad(field, format!("expected an activation name, found {v}")))
            }
        };
        let activation = match name.as_str() {
            "gelu" => Activation::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Activation::GeluTanh,
            "relu" => Activation::Relu,
            "silu" | "swish" => Activation::Silu,
            other => {
                return Err(self.bad(
                    field,
                    format!("activation {other:?} is not supported (gelu, gelu_new, gelu_pytorch_tanh, relu, silu)"),
                ))
            }
        };
        let composed = (opts.kernels == Kernels::Pytorch)
            .then(|| ComposedGelu::from_hf(&name))
            .flatten();
        Ok((activation, composed))
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

/// The sizes every family has.
struct Common {
    vocab: u64,
    hidden: u64,
    layers: u64,
    heads: u64,
    max_positions: u64,
}

/// GPT-2's names for [`Common`]'s fields, in its order.
const GPT2_FIELDS: [&str; 5] = ["vocab_size", "n_embd", "n_layer", "n_head", "n_positions"];
/// The other families' names for them.
const FIELDS: [&str; 5] = [
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
];

impl Common {
    /// Reads `fields` in order (the first bad one is the one reported), each defaulting to
    /// the matching entry of `defaults`; `--layers` replaces the number of layers.
    fn read(
        cfg: &Cfg,
        opts: &ImportOptions,
        fields: [&str; 5],
        defaults: [u64; 5],
    ) -> Result<Self, ImportError> {
        let [vocab, hidden, layers, heads, positions] = fields;
        Ok(Common {
            vocab: cfg.uint(vocab, Some(defaults[0]))?,
            hidden: cfg.uint(hidden, Some(defaults[1]))?,
            layers: cfg.layers(opts, layers, defaults[2])?,
            heads: cfg.uint(heads, Some(defaults[3]))?,
            max_positions: cfg.uint(positions, Some(defaults[4]))?,
        })
    }
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
        kernels: opts.kernels,
        composed_gelu: None,
        dtype: DType::Bf16,
    }
}

/// An op's id (within its block, for block ops) and its module path in `transformers`.
type Name = (&'static str, &'static str);

/// A family's layout: what its ops are called, and the ops only some families have. The
/// config says what the model computes (widths, biases, norm kind and position, dropout);
/// [`Template::build`] emits embeddings, the blocks, the final norm and the head from both.
struct Template {
    /// Token embedding, `embed_dim` wide.
    tokens: Name,
    /// Learned position table, `position_offset` rows longer (rotary positions have no op).
    positions: Option<Name>,
    /// BERT's segment embedding.
    token_types: Option<Name>,
    /// Module of the sum of several embeddings (op `embed`).
    embed_sum: Option<&'static str>,
    /// Norm on the summed embeddings; the embedding dropout follows it, else the sum.
    embed_norm: Option<Name>,
    /// OPT's `project_in` and `project_out`, used where `embed_dim` ≠ hidden.
    project: Option<[Name; 2]>,
    /// Prefixes of a block's op ids and module paths; the block's index follows.
    block: Name,
    /// Before attention (pre-norm) or after its residual add (post-norm).
    attn_norm: Name,
    /// One fused QKV projection, or separate Q, K and V.
    qkv: &'static [Name],
    attn_core: Name,
    attn_out: Name,
    /// Modules of the residual adds after attention (op `add_1`) and after the MLP (`add_2`).
    residuals: [&'static str; 2],
    /// Before the MLP (pre-norm) or after its residual add (post-norm).
    mlp_norm: Name,
    /// The up projection, or a gated MLP's gate and up projections.
    mlp_in: &'static [Name],
    act: Name,
    mlp_out: Name,
    /// Used where the config has a final norm.
    final_norm: Option<Name>,
    /// BERT's prediction transform before the decoder: dense, activation, norm.
    head_transform: Option<[Name; 3]>,
    /// Projection onto the vocabulary, tied to `tokens` where the config ties them.
    head: Name,
    /// Norms carry weights (OPT's `layer_norm_elementwise_affine` may say not).
    norm_affine: bool,
}

const GPT2: Template = Template {
    tokens: ("wte", "transformer.wte"),
    positions: Some(("wpe", "transformer.wpe")),
    token_types: None,
    embed_sum: Some("transformer.drop"),
    embed_norm: None,
    project: None,
    block: ("h", "transformer.h"),
    attn_norm: ("ln_1", "ln_1"),
    qkv: &[("attn.c_attn", "attn.c_attn")],
    attn_core: ("attn.core", "attn"),
    attn_out: ("attn.c_proj", "attn.c_proj"),
    residuals: ["attn.resid_dropout", "mlp.dropout"],
    mlp_norm: ("ln_2", "ln_2"),
    mlp_in: &[("mlp.c_fc", "mlp.c_fc")],
    act: ("mlp.act", "mlp.act"),
    mlp_out: ("mlp.c_proj", "mlp.c_proj"),
    final_norm: Some(("ln_f", "transformer.ln_f")),
    head_transform: None,
    head: ("lm_head", "lm_head"),
    norm_affine: true,
};

const OPT: Template = Template {
    tokens: ("embed_tokens", "model.decoder.embed_tokens"),
    positions: Some(("embed_positions", "model.decoder.embed_positions")),
    embed_sum: Some("model.decoder.dropout"),
    project: Some([
        ("project_in", "model.decoder.project_in"),
        ("project_out", "model.decoder.project_out"),
    ]),
    block: ("layers", "model.decoder.layers"),
    attn_norm: ("self_attn_layer_norm", "self_attn_layer_norm"),
    attn_out: ("self_attn.out_proj", "self_attn.out_proj"),
    residuals: ["dropout_1", "dropout_2"],
    mlp_norm: ("final_layer_norm", "final_layer_norm"),
    mlp_in: &[("fc1", "fc1")],
    act: ("act", "activation_fn"),
    mlp_out: ("fc2", "fc2"),
    final_norm: Some(("final_layer_norm", "model.decoder.final_layer_norm")),
    // Q, K, V, the attention core and the head as Llama names them; no segments or
    // embedding norm.
    ..LLAMA
};

const LLAMA: Template = Template {
    tokens: ("embed_tokens", "model.embed_tokens"),
    positions: None,
    token_types: None,
    embed_sum: None,
    embed_norm: None,
    project: None,
    block: ("layers", "model.layers"),
    attn_norm: ("input_layernorm", "input_layernorm"),
    qkv: &[
        ("self_attn.q_proj", "self_attn.q_proj"),
        ("self_attn.k_proj", "self_attn.k_proj"),
        ("self_attn.v_proj", "self_attn.v_proj"),
    ],
    attn_core: ("self_attn.core", "self_attn"),
    attn_out: ("self_attn.o_proj", "self_attn.o_proj"),
    residuals: ["residual_1", "residual_2"],
    mlp_norm: ("post_attention_layernorm", "post_attention_layernorm"),
    mlp_in: &[
        ("mlp.gate_proj", "mlp.gate_proj"),
        ("mlp.up_proj", "mlp.up_proj"),
    ],
    act: ("mlp.act", "mlp.act_fn"),
    mlp_out: ("mlp.down_proj", "mlp.down_proj"),
    final_norm: Some(("norm", "model.norm")),
    head_transform: None,
    head: ("lm_head", "lm_head"),
    norm_affine: true,
};

const BERT: Template = Template {
    tokens: ("word_embeddings", "bert.embeddings.word_embeddings"),
    positions: Some(("position_embeddings", "bert.embeddings.position_embeddings")),
    token_types: Some((
        "token_type_embeddings",
        "bert.embeddings.token_type_embeddings",
    )),
    embed_sum: Some("bert.embeddings"),
    embed_norm: Some(("embed_ln", "bert.embeddings.LayerNorm")),
    project: None,
    block: ("layer", "bert.encoder.layer"),
    attn_norm: ("attention.ln", "attention.output.LayerNorm"),
    qkv: &[
        ("attention.query", "attention.self.query"),
        ("attention.key", "attention.self.key"),
        ("attention.value", "attention.self.value"),
    ],
    attn_core: ("attention.core", "attention.self"),
    attn_out: ("attention.output", "attention.output.dense"),
    residuals: ["attention.output.dropout", "output.dropout"],
    mlp_norm: ("output.ln", "output.LayerNorm"),
    mlp_in: &[("intermediate", "intermediate.dense")],
    act: ("act", "intermediate.intermediate_act_fn"),
    mlp_out: ("output", "output.dense"),
    final_norm: None,
    head_transform: Some([
        ("cls.transform", "cls.predictions.transform.dense"),
        ("cls.act", "cls.predictions.transform.transform_act_fn"),
        ("cls.ln", "cls.predictions.transform.LayerNorm"),
    ]),
    head: ("cls.decoder", "cls.predictions.decoder"),
    norm_affine: true,
};

impl Template {
    /// The model's graph: embeddings, `c.layers` blocks, final norm, head and loss.
    fn build(&self, c: ModelConfig) -> GraphBuilder {
        let (h, e, v, layers) = (c.hidden, c.embed_dim, c.vocab_size, c.layers);
        let project = self.project.filter(|_| e != h);
        let final_norm = self.final_norm.filter(|_| c.final_norm);
        let (lm_bias, tied) = (c.bias.lm_head, c.tied_embeddings);
        let mut g = GraphBuilder::new(c);
        let mut x = self.embeddings(&mut g, project.map(|p| p[0]));
        for i in 0..layers {
            x = self.block(&mut g, i, x);
        }
        g.set_block(None);
        if let Some((id, m)) = final_norm {
            x = g.norm(id, m, &x, self.norm_affine, false);
        }
        if let Some([_, (id, m)]) = project {
            x = g.linear(id, m, &x, e, false, None);
        }
        if let Some([dense, act, norm]) = self.head_transform {
            // The prediction transform's dense layer always has a bias.
            x = g.linear(dense.0, dense.1, &x, h, true, None);
            x = g.activation(act.0, act.1, &[&x]);
            x = g.norm(norm.0, norm.1, &x, self.norm_affine, false);
        }
        let tied_to = format!("{}.weight", self.tokens.0);
        let (id, m) = self.head;
        let logits = g.linear(id, m, &x, v, lm_bias, tied.then_some(tied_to.as_str()));
        g.cross_entropy("loss", "loss", &logits);
        g
    }

    /// Token embedding (projected in where `project_in` is given), learned positions and
    /// segments, their sum and its norm; returns the op the first block reads.
    fn embeddings(&self, g: &mut GraphBuilder, project_in: Option<Name>) -> String {
        let c = g.config();
        let (h, e, v) = (c.hidden, c.embed_dim, c.vocab_size);
        let positions = c.max_positions + c.position_offset;
        let types = c.type_vocab_size;
        let mut tok = g.embedding(self.tokens.0, self.tokens.1, v, e);
        if let Some((id, m)) = project_in {
            tok = g.linear(id, m, &tok, h, false, None);
        }
        let mut parts = vec![tok];
        if let Some((id, m)) = self.positions {
            parts.push(g.positional(id, m, positions, h));
        }
        if let Some((id, m)) = self.token_types {
            parts.push(g.embedding(id, m, types, h));
        }
        let Some(sum) = self.embed_sum else {
            return parts.swap_remove(0);
        };
        let x = g.add("embed", sum, &strs(&parts), self.embed_norm.is_none());
        match self.embed_norm {
            Some((id, m)) => g.norm(id, m, &x, self.norm_affine, true),
            None => x,
        }
    }

    /// Block `i` on input `x`: attention, then the MLP; returns the block's output.
    fn block(&self, g: &mut GraphBuilder, i: u64, x: String) -> String {
        g.set_block(Some(i as u32));
        let b = Block { t: self, i };
        let c = g.config();
        let (h, f, bias) = (c.hidden, c.ffn_hidden, c.bias);
        let (qd, kvd) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let qkv_widths = match self.qkv.len() {
            1 => vec![qd + 2 * kvd],
            _ => vec![qd, kvd, kvd],
        };
        let add_1 = ("add_1", self.residuals[0]);
        let x = b.sublayer(g, self.attn_norm, add_1, x, |g, input| {
            let qkv: Vec<String> = self
                .qkv
                .iter()
                .zip(&qkv_widths)
                .map(|(&name, &width)| b.linear(g, name, input, width, bias.qkv))
                .collect();
            let (id, m) = b.at(self.attn_core);
            let att = g.attention(&id, &m, &strs(&qkv));
            b.linear(g, self.attn_out, &att, h, bias.attn_out)
        });
        let add_2 = ("add_2", self.residuals[1]);
        b.sublayer(g, self.mlp_norm, add_2, x, |g, input| {
            let up: Vec<String> = self
                .mlp_in
                .iter()
                .map(|&name| b.linear(g, name, input, f, bias.mlp))
                .collect();
            let (id, m) = b.at(self.act);
            let act = g.activation(&id, &m, &strs(&up));
            b.linear(g, self.mlp_out, &act, h, bias.mlp)
        })
    }
}

/// Block `i` of a template: names its ops and wraps its sub-layers.
struct Block<'t> {
    t: &'t Template,
    i: u64,
}

impl Block<'_> {
    /// The op's id and module path in this block.
    fn at(&self, (id, m): Name) -> (String, String) {
        let ((pre, mp), i) = (self.t.block, self.i);
        (format!("{pre}{i}.{id}"), format!("{mp}.{i}.{m}"))
    }

    fn linear(
        &self,
        g: &mut GraphBuilder,
        name: Name,
        input: &str,
        width: u64,
        bias: bool,
    ) -> String {
        let (id, m) = self.at(name);
        g.linear(&id, &m, input, width, bias, None)
    }

    fn norm(&self, g: &mut GraphBuilder, name: Name, input: &str) -> String {
        let (id, m) = self.at(name);
        g.norm(&id, &m, input, self.t.norm_affine, false)
    }

    /// `x + body(x)`, normed before `body` (pre-norm) or after the add (post-norm). The
    /// builder counts the residual dropout's mask only where the config has dropout.
    fn sublayer(
        &self,
        g: &mut GraphBuilder,
        norm: Name,
        add: Name,
        x: String,
        body: impl FnOnce(&mut GraphBuilder, &str) -> String,
    ) -> String {
        let pre_norm = g.config().norm_position == NormPosition::Pre;
        let input = if pre_norm {
            self.norm(g, norm, &x)
        } else {
            x.clone()
        };
        let y = body(g, &input);
        let (id, m) = self.at(add);
        let sum = g.add(&id, &m, &[&x, &y], true);
        if pre_norm {
            sum
        } else {
            self.norm(g, norm, &sum)
        }
    }
}

fn strs(ids: &[String]) -> Vec<&str> {
    ids.iter().map(String::as_str).collect()
}

fn gpt2(cfg: &Cfg, opts: &ImportOptions) -> Result<(ModelConfig, Template), ImportError> {
    let common = Common::read(cfg, opts, GPT2_FIELDS, [50257, 768, 12, 12, 1024])?;
    cfg.heads_divide(common.hidden, common.heads, "n_head")?;
    let mut c = base_config(&common, cfg.seq_len(opts, common.max_positions)?, opts);
    c.ffn_hidden = cfg.opt_uint("n_inner")?.unwrap_or(4 * common.hidden);
    c.norm_eps = cfg.float("layer_norm_epsilon", 1e-5)?;
    (c.activation, c.composed_gelu) = cfg.activation("activation_function", "gelu_new", opts)?;
    c.tied_embeddings = cfg.flag("tie_word_embeddings", true)?;
    c.dropout = cfg.float("resid_pdrop", 0.1)?;
    c.attention_dropout = cfg.float("attn_pdrop", 0.1)?;
    Ok((c, GPT2))
}

fn opt(cfg: &Cfg, opts: &ImportOptions) -> Result<(ModelConfig, Template), ImportError> {
    let common = Common::read(cfg, opts, FIELDS, [50272, 768, 12, 12, 2048])?;
    cfg.heads_divide(common.hidden, common.heads, "num_attention_heads")?;
    let mut c = base_config(&common, cfg.seq_len(opts, common.max_positions)?, opts);
    let pre_norm = cfg.flag("do_layer_norm_before", true)?;
    let affine = cfg.flag("layer_norm_elementwise_affine", true)?;
    let bias = cfg.flag("enable_bias", true)?;
    c.embed_dim = cfg
        .opt_uint("word_embed_proj_dim")?
        .unwrap_or(common.hidden);
    c.ffn_hidden = cfg.uint("ffn_dim", Some(3072))?;
    (c.activation, c.composed_gelu) = cfg.activation("activation_function", "relu", opts)?;
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
    Ok((
        c,
        Template {
            norm_affine: affine,
            ..OPT
        },
    ))
}

fn llama(
    cfg: &Cfg,
    opts: &ImportOptions,
    arch: &str,
) -> Result<(ModelConfig, Template), ImportError> {
    // Defaults of LlamaConfig, MistralConfig and Qwen2Config respectively.
    let (vocab, ffn, kv, max_pos) = match arch {
        "MistralForCausalLM" => (32000, 14336, 8, 4096 * 32),
        "Qwen2ForCausalLM" => (151936, 22016, 32, 32768),
        _ => (32000, 11008, 32, 2048),
    };
    let common = Common::read(cfg, opts, FIELDS, [vocab, 4096, 32, 32, max_pos])?;
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
    (c.activation, c.composed_gelu) = cfg.activation("hidden_act", "silu", opts)?;
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
    Ok((c, LLAMA))
}

fn bert(cfg: &Cfg, opts: &ImportOptions) -> Result<(ModelConfig, Template), ImportError> {
    let common = Common::read(cfg, opts, FIELDS, [30522, 768, 12, 12, 512])?;
    cfg.heads_divide(common.hidden, common.heads, "num_attention_heads")?;
    let mut c = base_config(&common, cfg.seq_len(opts, common.max_positions)?, opts);
    c.ffn_hidden = cfg.uint("intermediate_size", Some(3072))?;
    c.norm_eps = cfg.float("layer_norm_eps", 1e-12)?;
    c.norm_position = NormPosition::Post;
    c.final_norm = false;
    (c.activation, c.composed_gelu) = cfg.activation("hidden_act", "gelu", opts)?;
    c.tied_embeddings = cfg.flag("tie_word_embeddings", true)?;
    c.bias.lm_head = true;
    c.type_vocab_size = cfg.uint("type_vocab_size", Some(2))?;
    c.causal = false;
    c.dropout = cfg.float("hidden_dropout_prob", 0.1)?;
    c.attention_dropout = cfg.float("attention_probs_dropout_prob", 0.1)?;
    Ok((c, BERT))
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
    fn pytorch_kernels_keep_what_eager_modules_keep_beside_osdps() {
        let pytorch = |text: &str| {
            let opts = ImportOptions {
                kernels: Kernels::Pytorch,
                ..Default::default()
            };
            import_str(Path::new("config.json"), text, &opts).expect("imports")
        };
        // GPT-2: each LayerNorm an fp32 mean and reciprocal deviation per row; the attention
        // out-projection its own contiguous copy of the heads' output (bf16); `gelu_new`,
        // written as PyTorch ops, three more tensors of the MLP's width (bf16).
        let (osdp, eager) = (
            import(GPT2_SMALL, AttentionImpl::Flash),
            pytorch(GPT2_SMALL),
        );
        assert_eq!(eager.config.composed_gelu, Some(ComposedGelu::New));
        assert_eq!(osdp.config.composed_gelu, None);
        let (s, h) = (1024u64, 768u64);
        assert_eq!(
            block_saved(&eager, 0),
            block_saved(&osdp, 0) + 2 * (8 * s) + 2 * s * h + 3 * 2 * s * 4 * h
        );
        // The fused tanh GELU keeps nothing more.
        let fused = GPT2_SMALL.replacen('{', r#"{"activation_function": "gelu_pytorch_tanh", "#, 1);
        let fused = pytorch(&fused);
        assert_eq!(fused.config.composed_gelu, None);
        assert_eq!(
            block_saved(&fused, 0),
            block_saved(&osdp, 0) + 2 * (8 * s) + 2 * s * h
        );
        // LLaMA: each RMSNorm its fp32 input and an fp32 reciprocal per row beside the bf16
        // normalised tensor (which stands where osdp's kept input was); the out-projection its
        // copy; the gated MLP the SiLU's output.
        let text = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 256,
            "intermediate_size": 688, "num_hidden_layers": 1, "num_attention_heads": 8,
            "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 64}"#;
        let (osdp, eager) = (import(text, AttentionImpl::Flash), pytorch(text));
        let (s, h, f) = (64u64, 256u64, 688u64);
        assert_eq!(
            block_saved(&eager, 0),
            block_saved(&osdp, 0) + 2 * (4 * s * h + 4 * s) + 2 * s * h + 2 * s * f
        );
        // Only the saved bytes differ, and the fp32 parts stay fp32 when the cost model converts.
        assert_eq!(eager.param_count(), osdp.param_count());
        let norm = eager
            .ops
            .iter()
            .find(|o| o.kind == crate::model::OpKind::RmsNorm)
            .unwrap();
        assert_eq!(
            crate::model::saved::fixed_dtype_saved_bytes(norm, &eager.config),
            4 * s * h + 4 * s
        );
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
