//! Reading, checking and writing `model.json`.
//!
//! Reading is two passes: serde (strict: unknown, missing and mistyped fields are errors with
//! file, line:column and field path), then [`validate`] for what JSON cannot express (a graph
//! that references missing ops, has a cycle, has shapes that do not connect, or sizes that
//! overflow), naming the op at fault.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use super::{
    ModelConfig, ModelSpec, OpKind, OpSpec, ParamSpec, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB,
    MAX_WIDTH, MODEL_FORMAT_VERSION,
};
use crate::input::{self, InputError, Problem};

/// Every size derived from a parameter count must still fit in `u64` after this factor.
use crate::cost::STATE_BYTES_PER_PARAM;

/// Read and check a model description.
pub fn read_model(path: &Path) -> Result<ModelSpec, InputError> {
    let spec: ModelSpec = input::read_strict(path, MODEL_FORMAT_VERSION)?;
    checked(path, spec)
}

/// Parse and check a description held in memory; `path` is only used in messages.
pub fn from_json_str(path: &Path, text: &str) -> Result<ModelSpec, InputError> {
    let spec: ModelSpec = input::parse_strict(path, text, MODEL_FORMAT_VERSION)?;
    checked(path, spec)
}

fn checked(path: &Path, spec: ModelSpec) -> Result<ModelSpec, InputError> {
    validate(&spec).map_err(|problem| InputError::Invalid {
        path: path.to_path_buf(),
        problem,
    })?;
    Ok(spec)
}

/// Write a description atomically.
pub fn write_model(path: &Path, spec: &ModelSpec) -> std::io::Result<()> {
    input::write_json_atomically(path, spec)
}

/// Check everything serde cannot: the graph, the shapes, the sizes.
pub fn validate(m: &ModelSpec) -> Result<(), Problem> {
    if m.version != MODEL_FORMAT_VERSION {
        return Err(Problem::field(
            "version",
            format!(
                "format version {} is not supported (this build reads version {MODEL_FORMAT_VERSION})",
                m.version
            ),
        ));
    }
    if m.name.trim().is_empty() {
        return Err(Problem::field("name", "must not be empty"));
    }
    check_config(m)?;
    if m.ops.is_empty() {
        return Err(Problem::field(
            "ops",
            "the graph is empty: a model needs at least one operator",
        ));
    }
    let index = index_ops(m)?;
    for (i, op) in m.ops.iter().enumerate() {
        check_op_local(m, i, op, &index)?;
    }
    check_acyclic(m, &index)?;
    for (i, op) in m.ops.iter().enumerate() {
        check_shapes(m, i, op, &index)?;
    }
    check_totals(m)?;
    let losses = m
        .ops
        .iter()
        .filter(|o| o.kind == OpKind::CrossEntropy)
        .count();
    // A described PyTorch module computes its loss inside a `module` op (or its `loss_fn`'s).
    if losses != 1 && m.family != super::Family::Torch {
        return Err(Problem::field(
            "ops",
            format!(
                "a training graph needs exactly one cross_entropy op (the loss); found {losses}"
            ),
        ));
    }
    Ok(())
}

/// Each integer of a model's config: its name, its value, the range it must be in, and what
/// it counts. The one home of these bounds: every model, read from a file or imported, is held
/// to them before anything multiplies them out (the planner's sizes, the trainer's tensors).
fn config_ranges(c: &ModelConfig) -> [(&'static str, u64, u64, u64, &'static str); 12] {
    [
        ("vocab_size", c.vocab_size, 1, MAX_VOCAB, "tokens"),
        ("seq_len", c.seq_len, 1, MAX_WIDTH, "tokens"),
        (
            "max_positions",
            c.max_positions,
            1,
            MAX_POSITIONS,
            "positions",
        ),
        ("hidden", c.hidden, 1, MAX_WIDTH, "features"),
        ("embed_dim", c.embed_dim, 1, MAX_WIDTH, "features"),
        ("layers", c.layers, 1, MAX_LAYERS, "layers"),
        ("heads", c.heads, 1, MAX_WIDTH, "heads"),
        ("kv_heads", c.kv_heads, 1, MAX_WIDTH, "heads"),
        ("head_dim", c.head_dim, 1, MAX_WIDTH, "features"),
        ("ffn_hidden", c.ffn_hidden, 1, MAX_WIDTH, "features"),
        (
            "position_offset",
            c.position_offset,
            0,
            MAX_POSITIONS,
            "positions",
        ),
        (
            "type_vocab_size",
            c.type_vocab_size,
            0,
            MAX_VOCAB,
            "token types",
        ),
    ]
}

fn check_config(m: &ModelSpec) -> Result<(), Problem> {
    let c = &m.config;
    for (name, v, least, most, what) in config_ranges(c) {
        if v < least {
            return Err(Problem::field(
                &format!("config.{name}"),
                format!("must be at least {least}"),
            ));
        }
        if v > most {
            return Err(Problem::field(
                &format!("config.{name}"),
                format!("{v} {what} are too many (at most {most})"),
            ));
        }
    }
    if c.heads % c.kv_heads != 0 {
        return Err(Problem::field(
            "config.kv_heads",
            format!(
                "{} query heads cannot be grouped over {} key/value heads",
                c.heads, c.kv_heads
            ),
        ));
    }
    if c.seq_len > c.max_positions {
        return Err(Problem::field(
            "config.seq_len",
            format!(
                "{} is longer than max_positions {}",
                c.seq_len, c.max_positions
            ),
        ));
    }
    if !(c.norm_eps.is_finite() && c.norm_eps > 0.0) {
        return Err(Problem::field(
            "config.norm_eps",
            format!("must be a positive number, got {}", c.norm_eps),
        ));
    }
    for (name, p) in [
        ("dropout", c.dropout),
        ("attention_dropout", c.attention_dropout),
    ] {
        if !(p.is_finite() && (0.0..1.0).contains(&p)) {
            return Err(Problem::field(
                &format!("config.{name}"),
                format!("must be a probability in [0, 1), got {p}"),
            ));
        }
    }
    match (c.positional, c.rope_theta) {
        (super::Positional::Rotary, None) => {
            return Err(Problem::field(
                "config.rope_theta",
                "rotary positions need rope_theta",
            ))
        }
        (_, Some(t)) if !(t.is_finite() && t > 0.0) => {
            return Err(Problem::field(
                "config.rope_theta",
                format!("must be a positive number, got {t}"),
            ))
        }
        _ => {}
    }
    Ok(())
}

/// Map op id → index, refusing empty and duplicate ids.
fn index_ops(m: &ModelSpec) -> Result<HashMap<&str, usize>, Problem> {
    let mut index = HashMap::with_capacity(m.ops.len());
    for (i, op) in m.ops.iter().enumerate() {
        if op.id.trim().is_empty() {
            return Err(Problem::field(&format!("ops[{i}].id"), "must not be empty"));
        }
        if let Some(first) = index.insert(op.id.as_str(), i) {
            return Err(Problem::op(
                i,
                &op.id,
                format!("duplicate id: ops[{first}] has the same id"),
            ));
        }
    }
    Ok(index)
}

/// Product of dimensions, refusing zero, negative and overflowing shapes.
fn checked_numel(shape: &[i64], what: &str) -> Result<u64, String> {
    if shape.is_empty() {
        return Err(format!("{what} has an empty shape"));
    }
    let mut n: u64 = 1;
    for (d, &dim) in shape.iter().enumerate() {
        if dim <= 0 {
            let sign = if dim < 0 { "negative" } else { "zero" };
            return Err(format!(
                "{what} has a {sign} dimension: shape {shape:?}, dimension {d} is {dim}"
            ));
        }
        n = n.checked_mul(dim as u64).ok_or_else(|| {
            format!("{what} shape {shape:?} overflows: its size does not fit in 64 bits")
        })?;
    }
    Ok(n)
}

fn check_op_local(
    m: &ModelSpec,
    i: usize,
    op: &OpSpec,
    index: &HashMap<&str, usize>,
) -> Result<(), Problem> {
    let err = |msg: String| Problem::op(i, &op.id, msg);
    if let Some(b) = op.block {
        if u64::from(b) >= m.config.layers {
            return Err(err(format!(
                "block {b} is out of range: the model has {} layers (blocks 0..{})",
                m.config.layers,
                m.config.layers - 1
            )));
        }
    }
    for input in &op.inputs {
        if input == &op.id {
            return Err(err("reads its own output (a cycle of one op)".into()));
        }
        if !index.contains_key(input.as_str()) {
            return Err(err(format!("input {input:?} does not exist")));
        }
    }
    let mut names = HashSet::new();
    for p in &op.params {
        if !names.insert(p.name.as_str()) {
            return Err(err(format!("parameter {:?} appears twice", p.name)));
        }
        let what = format!("parameter {:?}", p.name);
        let n = checked_numel(&p.shape, &what).map_err(&err)?;
        if n.checked_mul(STATE_BYTES_PER_PARAM).is_none() {
            return Err(err(format!(
                "{what} shape {:?} overflows: its training state does not fit in 64 bits",
                p.shape
            )));
        }
        if let Some(target) = &p.tied_to {
            let owner = resolve_tie(m, index, target).map_err(|e| err(format!("{what}: {e}")))?;
            if owner.shape != p.shape {
                return Err(err(format!(
                    "{what} is tied to {target:?} of shape {:?} but has shape {:?}",
                    owner.shape, p.shape
                )));
            }
        }
    }
    let out = checked_numel(&op.output_shape, "output").map_err(&err)?;
    if out.checked_mul(8).is_none() {
        return Err(err(format!(
            "output shape {:?} overflows: its size in bytes does not fit in 64 bits",
            op.output_shape
        )));
    }
    Ok(())
}

fn resolve_tie<'m>(
    m: &'m ModelSpec,
    index: &HashMap<&str, usize>,
    target: &str,
) -> Result<&'m super::ParamSpec, String> {
    let (op_id, param) = super::split_param_key(target)
        .ok_or_else(|| format!("tied_to {target:?} must be OP_ID.PARAM"))?;
    let owner_op = index
        .get(op_id)
        .map(|&j| &m.ops[j])
        .ok_or_else(|| format!("tied_to {target:?} names op {op_id:?}, which does not exist"))?;
    let owner = owner_op
        .params
        .iter()
        .find(|p| p.name == param)
        .ok_or_else(|| format!("tied_to {target:?}: op {op_id:?} has no parameter {param:?}"))?;
    if owner.tied_to.is_some() {
        return Err(format!(
            "tied_to {target:?} is itself tied; tie to the parameter that owns the storage"
        ));
    }
    Ok(owner)
}

/// Refuse cycles, naming the ops on one of them.
fn check_acyclic(m: &ModelSpec, index: &HashMap<&str, usize>) -> Result<(), Problem> {
    let n = m.ops.len();
    let mut indegree = vec![0usize; n];
    let mut consumers: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, op) in m.ops.iter().enumerate() {
        for input in &op.inputs {
            let j = index[input.as_str()];
            indegree[i] += 1;
            consumers[j].push(i);
        }
    }
    let mut ready: Vec<usize> = (0..n).filter(|&i| indegree[i] == 0).collect();
    let mut done = 0;
    while let Some(j) = ready.pop() {
        done += 1;
        for &i in &consumers[j] {
            indegree[i] -= 1;
            if indegree[i] == 0 {
                ready.push(i);
            }
        }
    }
    if done == n {
        return Ok(());
    }
    // Every op left has an unfinished input; walking inputs from one of them must loop.
    let start = (0..n).find(|&i| indegree[i] > 0).unwrap_or(0);
    let mut seen = HashMap::new();
    let mut path = Vec::new();
    let mut at = start;
    while !seen.contains_key(&at) {
        seen.insert(at, path.len());
        path.push(at);
        at = m.ops[at]
            .inputs
            .iter()
            .map(|inp| index[inp.as_str()])
            .find(|&j| indegree[j] > 0)
            .unwrap_or(at);
    }
    // `path` follows inputs (consumer to producer); print it in data-flow order.
    let cycle: Vec<&str> = std::iter::once(m.ops[at].id.as_str())
        .chain(
            path[seen[&at]..]
                .iter()
                .rev()
                .map(|&i| m.ops[i].id.as_str()),
        )
        .collect();
    Err(Problem::op(
        at,
        &m.ops[at].id,
        format!("is on a cycle: {}", cycle.join(" -> ")),
    ))
}

fn dims(shape: &[i64]) -> String {
    format!("{shape:?}")
}

fn check_shapes(
    m: &ModelSpec,
    i: usize,
    op: &OpSpec,
    index: &HashMap<&str, usize>,
) -> Result<(), Problem> {
    let inputs: Vec<&OpSpec> = op
        .inputs
        .iter()
        .map(|s| &m.ops[index[s.as_str()]])
        .collect();
    let s = ShapeCheck {
        c: &m.config,
        i,
        op,
        inputs,
    };
    match op.kind {
        OpKind::Embedding | OpKind::PositionalEmbedding => s.embedding(),
        OpKind::LayerNorm | OpKind::RmsNorm => s.norm(),
        OpKind::Linear => s.linear(),
        OpKind::Attention => s.attention(),
        OpKind::Activation | OpKind::Add => s.elementwise(),
        OpKind::CrossEntropy => s.cross_entropy(),
        // Measured from the live module: any parameters, inputs and output.
        OpKind::Module => Ok(()),
    }
}

/// One op's shape check: the op, the ops feeding it, and the model's config.
struct ShapeCheck<'a> {
    c: &'a ModelConfig,
    i: usize,
    op: &'a OpSpec,
    inputs: Vec<&'a OpSpec>,
}

impl ShapeCheck<'_> {
    fn err(&self, msg: String) -> Problem {
        Problem::op(self.i, &self.op.id, msg)
    }

    fn arity(&self, allowed: &[usize]) -> Result<(), Problem> {
        if allowed.contains(&self.inputs.len()) {
            Ok(())
        } else {
            let want: Vec<String> = allowed.iter().map(|n| n.to_string()).collect();
            Err(self.err(format!(
                "a {} op takes {} input(s), this one has {}",
                self.op.kind.as_str(),
                want.join(" or "),
                self.inputs.len()
            )))
        }
    }

    fn param(&self, name: &str) -> Option<&ParamSpec> {
        self.op.params.iter().find(|p| p.name == name)
    }

    fn only_params(&self, allowed: &[&str]) -> Result<(), Problem> {
        match self
            .op
            .params
            .iter()
            .find(|p| !allowed.contains(&p.name.as_str()))
        {
            None => Ok(()),
            Some(p) => Err(self.err(format!(
                "a {} op has no parameter {:?} (allowed: {})",
                self.op.kind.as_str(),
                p.name,
                if allowed.is_empty() {
                    "none".to_string()
                } else {
                    allowed.join(", ")
                }
            ))),
        }
    }

    fn expect_out(&self, want: &[i64]) -> Result<(), Problem> {
        if self.op.output_shape == want {
            Ok(())
        } else {
            Err(self.err(format!(
                "output_shape is {} but its inputs give {}",
                dims(&self.op.output_shape),
                dims(want)
            )))
        }
    }

    /// The "weight" parameter, which must be a matrix; `layout` names its axes in messages.
    fn weight_matrix(&self, layout: &str) -> Result<&ParamSpec, Problem> {
        let w = self
            .param("weight")
            .ok_or_else(|| self.err("needs a \"weight\" parameter".into()))?;
        if w.shape.len() != 2 {
            return Err(self.err(format!("weight must be [{layout}], got {}", dims(&w.shape))));
        }
        Ok(w)
    }

    /// Token and position tables: no inputs, a `[rows, dim]` weight, `[seq_len, dim]` out.
    fn embedding(&self) -> Result<(), Problem> {
        let c = self.c;
        self.arity(&[0])?;
        self.only_params(&["weight"])?;
        let w = self.weight_matrix("rows, dim")?;
        if self.op.kind == OpKind::PositionalEmbedding {
            let needed = c.seq_len + c.position_offset;
            if (w.shape[0] as u64) < needed {
                return Err(self.err(format!(
                    "position table has {} rows but seq_len {} (+ offset {}) needs {needed}",
                    w.shape[0], c.seq_len, c.position_offset
                )));
            }
        }
        self.expect_out(&[c.seq_len as i64, w.shape[1]])
    }

    /// LayerNorm and RMSNorm: every parameter is as wide as the input, shape preserved.
    fn norm(&self) -> Result<(), Problem> {
        self.arity(&[1])?;
        let x = &self.inputs[0].output_shape;
        let width = *x.last().unwrap_or(&0);
        let allowed: &[&str] = if self.op.kind == OpKind::LayerNorm {
            &["weight", "bias"]
        } else {
            &["weight"]
        };
        self.only_params(allowed)?;
        for p in &self.op.params {
            if p.shape != [width] {
                return Err(self.err(format!(
                    "parameter {:?} has shape {} but normalises input {:?} of width {width}",
                    p.name,
                    dims(&p.shape),
                    self.inputs[0].id
                )));
            }
        }
        self.expect_out(x)
    }

    /// A `[out, in]` weight (and optional `[out]` bias) maps the input's last axis to `out`.
    fn linear(&self) -> Result<(), Problem> {
        self.arity(&[1])?;
        self.only_params(&["weight", "bias"])?;
        let w = self.weight_matrix("out, in")?;
        let (out_f, in_f) = (w.shape[0], w.shape[1]);
        let x = &self.inputs[0].output_shape;
        let width = *x.last().unwrap_or(&0);
        if width != in_f {
            return Err(self.err(format!(
                "shapes do not connect: weight {} expects {in_f} input features but input {:?} has width {width} (shape {})",
                dims(&w.shape),
                self.inputs[0].id,
                dims(x)
            )));
        }
        if let Some(b) = self.param("bias") {
            if b.shape != [out_f] {
                return Err(self.err(format!("bias must be [{out_f}], got {}", dims(&b.shape))));
            }
        }
        let mut want = x.clone();
        *want.last_mut().expect("input shape checked non-empty") = out_f;
        self.expect_out(&want)
    }

    /// Fused QKV or separate Q, K, V inputs of the configured head widths; out is Q-wide.
    fn attention(&self) -> Result<(), Problem> {
        let c = self.c;
        let inputs = &self.inputs;
        self.arity(&[1, 3])?;
        self.only_params(&[])?;
        let (q, kv) = (
            (c.heads * c.head_dim) as i64,
            (c.kv_heads * c.head_dim) as i64,
        );
        let widths: Vec<i64> = inputs
            .iter()
            .map(|o| *o.output_shape.last().unwrap_or(&0))
            .collect();
        let want: Vec<i64> = if inputs.len() == 1 {
            vec![q + 2 * kv]
        } else {
            vec![q, kv, kv]
        };
        if widths != want {
            return Err(self.err(format!(
                "shapes do not connect: with {} heads, {} key/value heads of {} dims the input widths must be {want:?}, got {widths:?}",
                c.heads, c.kv_heads, c.head_dim
            )));
        }
        let lead = &inputs[0].output_shape[..inputs[0].output_shape.len() - 1];
        for o in &inputs[1..] {
            if &o.output_shape[..o.output_shape.len() - 1] != lead {
                return Err(self.err(format!(
                    "shapes do not connect: inputs {:?} {} and {:?} {} differ in leading dimensions",
                    inputs[0].id,
                    dims(&inputs[0].output_shape),
                    o.id,
                    dims(&o.output_shape)
                )));
            }
        }
        let mut out = lead.to_vec();
        out.push(q);
        self.expect_out(&out)
    }

    /// Activations (one input, or two for gated ones) and adds: all inputs share one shape.
    fn elementwise(&self) -> Result<(), Problem> {
        let inputs = &self.inputs;
        if self.op.kind == OpKind::Activation {
            self.arity(&[1, 2])?;
        } else if inputs.len() < 2 {
            return Err(self.err(format!(
                "an add op sums 2 or more inputs, this one has {}",
                inputs.len()
            )));
        }
        self.only_params(&[])?;
        let x = &inputs[0].output_shape;
        for o in &inputs[1..] {
            if &o.output_shape != x {
                return Err(self.err(format!(
                    "shapes do not connect: input {:?} is {} but input {:?} is {}",
                    inputs[0].id,
                    dims(x),
                    o.id,
                    dims(&o.output_shape)
                )));
            }
        }
        self.expect_out(x)
    }

    /// The loss takes logits ending in vocab_size and gives one number.
    fn cross_entropy(&self) -> Result<(), Problem> {
        self.arity(&[1])?;
        self.only_params(&[])?;
        let x = &self.inputs[0].output_shape;
        if *x.last().unwrap_or(&0) as u64 != self.c.vocab_size {
            return Err(self.err(format!(
                "shapes do not connect: logits {:?} {} must end in vocab_size {}",
                self.inputs[0].id,
                dims(x),
                self.c.vocab_size
            )));
        }
        self.expect_out(&[1])
    }
}

/// Whole-model sums must fit too: they feed the planner's arithmetic.
fn check_totals(m: &ModelSpec) -> Result<(), Problem> {
    let mut params: u64 = 0;
    let mut flops: u64 = 0;
    let mut saved: u64 = 0;
    for (i, op) in m.ops.iter().enumerate() {
        let overflow = |what: &str| {
            Problem::op(
                i,
                &op.id,
                format!("{what} overflows when added to the model's total"),
            )
        };
        params = params
            .checked_add(ModelSpec::op_param_count(op))
            .filter(|p| p.checked_mul(STATE_BYTES_PER_PARAM).is_some())
            .ok_or_else(|| overflow("parameter count"))?;
        flops = flops
            .checked_add(op.fwd_flops_per_sample)
            .and_then(|f| f.checked_mul(4))
            .map(|f| f / 4)
            .ok_or_else(|| overflow("fwd_flops_per_sample"))?;
        saved = saved
            .checked_add(op.saved_bytes_per_sample)
            .and_then(|s| s.checked_add(op.output_bytes_per_sample))
            .ok_or_else(|| overflow("activation bytes"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 32: `position_offset` 2^64 − 1 was read, then overflowed the trainer's positions.
    /// Every integer of the config is bounded where the model is read, naming the field.
    #[test]
    fn every_config_integer_is_bounded_naming_its_field() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let model = read_model(&root.join("sample-models/tiny-opt.json")).unwrap();
        let json = serde_json::to_value(&model).unwrap();
        let integers = json["config"]
            .as_object()
            .unwrap()
            .iter()
            .filter(|(_, v)| v.is_u64())
            .count();
        let ranges = config_ranges(&model.config);
        assert_eq!(
            ranges.len(),
            integers,
            "an integer of the config has no range"
        );
        for (name, _, _, most, _) in ranges {
            for past in [most + 1, u64::MAX] {
                let mut bad = json.clone();
                bad["config"][name] = past.into();
                let bad: ModelSpec = serde_json::from_value(bad).unwrap();
                let e = validate(&bad).unwrap_err().to_string();
                assert!(
                    e.contains(&format!("config.{name}: {past} "))
                        && e.contains(&format!("at most {most}")),
                    "{name} = {past}: {e}"
                );
            }
        }
    }
}
