//! The forward pass: each op's kernel with its weights gathered and released, and the
//! activations the executor holds between ops (what forward keeps for backward, what a
//! recomputed block restarts from, what the next op still needs).

use tch::{Kind, Tensor};

use super::{nbytes, ops, ExecError, Executor, Held, Result};
use crate::memory::Category;
use osdp_core::model::OpKind;

impl Executor {
    pub(super) fn input(&self, i: usize, k: usize) -> Tensor {
        let j = self.flow.inputs[i][k];
        match &self.outs[j] {
            Some(h) => h.t.shallow_clone(),
            None => panic!(
                "op {}'s input {} is not held",
                self.model.ops[i].id, self.model.ops[j].id
            ),
        }
    }

    pub(super) fn hold(&mut self, i: usize, t: Tensor, cat: Category) {
        self.ledger.add(cat, nbytes(&t));
        self.outs[i] = Some(Held { t, cat });
    }

    pub(super) fn drop_out(&mut self, i: usize) {
        if let Some(h) = self.outs[i].take() {
            self.ledger.sub(h.cat, nbytes(&h.t));
        }
    }

    pub(super) fn set_extras(&mut self, i: usize, extras: Vec<Tensor>) {
        for t in &extras {
            self.ledger.add(Category::Activations, nbytes(t));
        }
        self.extras[i] = extras;
    }

    pub(super) fn drop_extras(&mut self, i: usize) {
        for t in std::mem::take(&mut self.extras[i]) {
            self.ledger.sub(Category::Activations, nbytes(&t));
        }
    }

    /// An attention op's queries, keys and values, from a fused input or three.
    pub(super) fn qkv(&self, i: usize) -> (Tensor, Tensor, Tensor) {
        let ins: Vec<Tensor> = (0..self.flow.inputs[i].len())
            .map(|k| self.input(i, k))
            .collect();
        let refs: Vec<&Tensor> = ins.iter().collect();
        ops::split_qkv(&refs, &self.attn)
    }

    pub(super) fn labels(&self) -> Result<Tensor> {
        self.labels
            .as_ref()
            .map(Tensor::shallow_clone)
            .ok_or_else(|| ExecError::Unsupported("no labels for the loss".into()))
    }

    pub(super) fn ids(&self) -> Tensor {
        self.ids
            .as_ref()
            .map(Tensor::shallow_clone)
            .unwrap_or_else(|| Tensor::zeros([1, 1], (Kind::Int64, self.device)))
    }

    pub(super) fn positions(&self) -> Tensor {
        let ids = self.ids();
        let (b, s) = (ids.size()[0], ids.size()[1]);
        (Tensor::arange(s, (Kind::Int64, self.device)) + self.position_offset)
            .unsqueeze(0)
            .expand([b, s], false)
    }

    /// Whether an embedding op reads token ids (else segment ids, all zero).
    pub(super) fn token_ids_for(&self, i: usize) -> Tensor {
        let rows = self.model.ops[i].params[0].shape[0] as u64;
        if rows == self.model.config.vocab_size {
            self.ids()
        } else {
            self.ids().zeros_like()
        }
    }

    /// Run op `i` forward; keep what its backward needs beside the output when `keep_extras`.
    fn forward_op(&mut self, i: usize, keep_extras: bool) -> Result<Tensor> {
        let kind = self.model.ops[i].kind;
        let out = match kind {
            OpKind::Embedding | OpKind::PositionalEmbedding => self.forward_embedding(i, kind)?,
            OpKind::Add => {
                let mut y = self.input(i, 0).copy();
                for k in 1..self.flow.inputs[i].len() {
                    y += self.input(i, k);
                }
                y
            }
            OpKind::LayerNorm | OpKind::RmsNorm => self.forward_norm(i, kind, keep_extras)?,
            OpKind::Linear => self.forward_linear(i)?,
            OpKind::Attention => {
                let (q, k, v) = self.qkv(i);
                let (out, saved) = ops::attention_fwd(&q, &k, &v, &self.attn, self.rope.as_ref());
                if keep_extras {
                    self.set_extras(i, saved);
                }
                out
            }
            OpKind::Activation => {
                if self.flow.inputs[i].len() == 2 {
                    ops::gated_fwd(self.act, &self.input(i, 0), &self.input(i, 1))
                } else {
                    ops::act_fwd(self.act, &self.input(i, 0))
                }
            }
            OpKind::CrossEntropy => {
                let logits = self.input(i, 0);
                let labels = self.labels()?;
                let (loss, logp) = ops::cross_entropy_fwd(&logits, &labels);
                if keep_extras {
                    self.set_extras(i, vec![logp]);
                }
                loss
            }
            OpKind::Module => return Err(unsupported_module(&self.model.ops[i].id)),
        };
        Ok(out)
    }

    /// A token or positional embedding op forward: its table's rows for the ids.
    fn forward_embedding(&mut self, i: usize, kind: OpKind) -> Result<Tensor> {
        let u = self.uses[i][0][0];
        let w = self.weight(u)?;
        let ids = if kind == OpKind::Embedding {
            self.token_ids_for(i)
        } else {
            self.positions()
        };
        let y = ops::embedding_fwd(&w, &ids);
        self.done_with(i, u, w);
        Ok(y)
    }

    /// A layer or RMS norm op forward; its statistics kept when `keep_extras`.
    fn forward_norm(&mut self, i: usize, kind: OpKind, keep_extras: bool) -> Result<Tensor> {
        let x = self.input(i, 0);
        let uw = self.uses[i][0][0];
        let ub = self.uses[i].get(1).map(|v| v[0]);
        let w = self.weight(uw)?;
        let b = match ub {
            Some(ub) => Some(self.weight(ub)?),
            None => None,
        };
        let (y, stats) = if kind == OpKind::LayerNorm {
            let (y, mean, rstd) = ops::layer_norm_fwd(&x, &w, b.as_ref(), self.norm_eps);
            (y, vec![mean, rstd])
        } else {
            let (y, rstd) = ops::rms_norm_fwd(&x, &w, self.norm_eps);
            (y, vec![rstd])
        };
        self.done_with(i, uw, w);
        if let (Some(ub), Some(b)) = (ub, b) {
            self.done_with(i, ub, b);
        }
        if keep_extras {
            self.set_extras(i, stats);
        }
        Ok(y)
    }

    /// A linear op forward: one partial product per column slice of its weight (each slice
    /// gathered, used and released in turn), summed, then the bias.
    fn forward_linear(&mut self, i: usize) -> Result<Tensor> {
        let x = self.input(i, 0);
        let slices = self.uses[i][0].clone();
        let mut y: Option<Tensor> = None;
        for u in slices {
            let w = self.weight(u)?;
            let xs = match self.units[u].cols {
                Some((start, len)) => x.narrow(-1, start, len),
                None => x.shallow_clone(),
            };
            let (part, padded) = ops::linear_fwd(&xs, &w);
            self.note_padded(i, &w, padded, true);
            self.done_with(i, u, w);
            y = Some(match y {
                Some(acc) => acc + part,
                None => part,
            });
        }
        let mut y = y.ok_or_else(|| ExecError::Unsupported("a linear without weight".into()))?;
        if let Some(bias) = self.uses[i].get(1).map(|v| v[0]) {
            let b = self.weight(bias)?;
            y += &b;
            self.done_with(i, bias, b);
        }
        Ok(y)
    }

    /// Run ops `range` forward. `full_pass`: the step's forward (keep what `keep_fwd` says);
    /// otherwise the recomputation of one block (keep what its backward needs).
    pub(super) fn forward_range(
        &mut self,
        range: std::ops::Range<usize>,
        full_pass: bool,
    ) -> Result<Option<Tensor>> {
        let mut remaining: Vec<usize> = self
            .flow
            .consumers
            .iter()
            .map(|c| c.iter().filter(|&&k| range.contains(&k)).count())
            .collect();
        let mut loss = None;
        for i in range.clone() {
            if !full_pass && self.outs[i].is_some() {
                // Already held (kept as the next block's restart point): no need to redo it.
                continue;
            }
            let keep_extras = !full_pass || self.flow.recomputed_block[i].is_none();
            let t0 = self.profile.is_some().then(|| self.clock());
            let c0 = self.collectives_so_far();
            let y = self.forward_op(i, keep_extras)?;
            let dt = t0.map(|t0| self.since(t0));
            if let (Some(p), Some(dt)) = (self.profile.as_mut(), dt) {
                if full_pass {
                    p.fwd_s[i] += dt;
                    p.fwd_coll_s[i] += p.collective_s_since(c0);
                } else {
                    p.recompute_s += dt;
                }
            }
            if self.model.ops[i].kind == OpKind::CrossEntropy {
                loss = Some(y.shallow_clone());
            }
            let kept = if full_pass {
                self.flow.keep_fwd[i]
            } else {
                self.flow.need_bwd[i]
            };
            if kept || remaining[i] > 0 || !full_pass {
                self.hold(
                    i,
                    y,
                    if kept {
                        Category::Activations
                    } else {
                        Category::Working
                    },
                );
            }
            for k in 0..self.flow.inputs[i].len() {
                let j = self.flow.inputs[i][k];
                remaining[j] = remaining[j].saturating_sub(1);
                let keep_j = if full_pass {
                    self.flow.keep_fwd[j]
                } else {
                    self.flow.need_bwd[j] || !range.contains(&j)
                };
                if remaining[j] == 0 && !keep_j {
                    self.drop_out(j);
                }
            }
        }
        Ok(loss)
    }
}

/// A `module` op (a model described from PyTorch) has no kernel in this trainer.
pub(super) fn unsupported_module(id: &str) -> ExecError {
    ExecError::Unsupported(format!(
        "op {id:?} is a described PyTorch module; run its plan with osdp_torch.apply_plan \
         (`osdp-tui export --to fsdp2`)"
    ))
}
