//! The backward pass, op by op: each op's gradient kernels, the activation gradients passed
//! to its inputs, and the parameter gradients handed to the units (reduce-scattered there
//! where sharded).

use tch::Tensor;

use super::{nbytes, ops, ExecError, Executor, Result};
use crate::memory::Category;
use osdp_core::model::{Activation, OpKind};

impl Executor {
    fn add_act_grad(&mut self, j: usize, g: Tensor) {
        match &mut self.grads[j] {
            Some(acc) => *acc += g,
            None => {
                self.ledger.add(Category::Working, nbytes(&g));
                self.grads[j] = Some(g);
            }
        }
    }

    /// Run op `i` backward from its output's gradient `g`: one arm per op kind, the longer
    /// ones in the methods below.
    pub(super) fn backward_op(&mut self, i: usize, g: &Tensor) -> Result<()> {
        let kind = self.model.ops[i].kind;
        match kind {
            OpKind::CrossEntropy => self.backward_loss(i, g)?,
            OpKind::Embedding | OpKind::PositionalEmbedding => {
                let u = self.uses[i][0][0];
                let rows = self.units[u].shape[0];
                let ids = if kind == OpKind::Embedding {
                    self.token_ids_for(i)
                } else {
                    self.positions()
                };
                let dw = ops::embedding_bwd(g, &ids, rows);
                self.add_param_grad(u, dw)?;
            }
            OpKind::Add => {
                for k in 0..self.flow.inputs[i].len() {
                    self.add_act_grad(self.flow.inputs[i][k], g.shallow_clone());
                }
            }
            OpKind::LayerNorm | OpKind::RmsNorm => self.backward_norm(i, kind, g)?,
            OpKind::Linear => self.backward_linear(i, g)?,
            OpKind::Attention => self.backward_attention(i, g)?,
            OpKind::Activation => self.backward_activation(i, g)?,
            OpKind::Module => {
                return Err(super::forward::unsupported_module(&self.model.ops[i].id))
            }
        }
        Ok(())
    }

    /// The loss op backward: the logits' gradient from the kept log-probabilities.
    fn backward_loss(&mut self, i: usize, g: &Tensor) -> Result<()> {
        let labels = self.labels()?;
        let scale = g.double_value(&[]);
        let logp = std::mem::take(&mut self.extras[i])
            .pop()
            .ok_or_else(|| ExecError::Unsupported("the loss kept nothing".into()))?;
        let (kept, in_place) = (nbytes(&logp), logp.kind() == self.kind);
        let d = ops::cross_entropy_bwd(scale, logp, &labels, self.kind);
        // The gradient is the log-probabilities' buffer itself when the compute dtype
        // is theirs (fp32); otherwise a copy in the compute dtype that exists beside
        // them until they are freed here.
        if in_place {
            self.ledger.sub(Category::Activations, kept);
            self.add_act_grad(self.flow.inputs[i][0], d);
        } else {
            self.add_act_grad(self.flow.inputs[i][0], d);
            self.ledger.sub(Category::Activations, kept);
        }
        Ok(())
    }

    /// A layer or RMS norm op backward, from the statistics its forward kept.
    fn backward_norm(&mut self, i: usize, kind: OpKind, g: &Tensor) -> Result<()> {
        let x = self.input(i, 0);
        let uw = self.uses[i][0][0];
        let w = self.weight(uw)?;
        if kind == OpKind::LayerNorm {
            let (dx, dw, db) = ops::layer_norm_bwd(
                g,
                &x,
                &self.extras[i][0],
                &self.extras[i][1],
                &w,
                self.norm_eps,
            );
            self.release(uw, w);
            self.add_param_grad(uw, dw)?;
            if let Some(ub) = self.uses[i].get(1).map(|v| v[0]) {
                self.add_param_grad(ub, db)?;
            }
            self.add_act_grad(self.flow.inputs[i][0], dx);
        } else {
            let (dx, dw) = ops::rms_norm_bwd(g, &x, &self.extras[i][0], &w, self.norm_eps);
            self.release(uw, w);
            self.add_param_grad(uw, dw)?;
            self.add_act_grad(self.flow.inputs[i][0], dx);
        }
        Ok(())
    }

    /// A linear op backward, column slice by column slice (each gathered again, its gradient
    /// handed over at once); the input's gradient is the slices' put back together.
    fn backward_linear(&mut self, i: usize, g: &Tensor) -> Result<()> {
        let x = self.input(i, 0);
        let slices = self.uses[i][0].clone();
        let mut dxs = Vec::with_capacity(slices.len());
        for u in slices {
            let w = self.weight(u)?;
            let xs = match self.units[u].cols {
                Some((start, len)) => x.narrow(-1, start, len),
                None => x.shallow_clone(),
            };
            let ((dx, dw), padded) = ops::linear_bwd(g, &xs, &w);
            self.note_padded(i, &w, padded, false);
            self.release(u, w);
            self.add_param_grad(u, dw)?;
            dxs.push(dx);
        }
        if let Some(ub) = self.uses[i].get(1).map(|v| v[0]) {
            self.add_param_grad(ub, ops::bias_grad(g))?;
        }
        let dx = if dxs.len() == 1 {
            dxs.pop().unwrap_or_else(|| g.zeros_like())
        } else {
            Tensor::cat(&dxs, -1)
        };
        self.add_act_grad(self.flow.inputs[i][0], dx);
        Ok(())
    }

    /// An attention op backward, from its kept output and log-sum-exp; the queries', keys' and
    /// values' gradients go to a fused input or to three.
    fn backward_attention(&mut self, i: usize, g: &Tensor) -> Result<()> {
        let (q, k, v) = self.qkv(i);
        let out = self.outs[i]
            .as_ref()
            .map(|h| h.t.shallow_clone())
            .ok_or_else(|| ExecError::Unsupported("attention output not kept".into()))?;
        let (dq, dk, dv) = ops::attention_bwd(
            g,
            &q,
            &k,
            &v,
            &out,
            &self.extras[i],
            &self.attn,
            self.rope.as_ref(),
        );
        if self.flow.inputs[i].len() == 1 {
            self.add_act_grad(self.flow.inputs[i][0], Tensor::cat(&[dq, dk, dv], -1));
        } else {
            let ins = self.flow.inputs[i].clone();
            self.add_act_grad(ins[0], dq);
            self.add_act_grad(ins[1], dk);
            self.add_act_grad(ins[2], dv);
        }
        Ok(())
    }

    /// An activation op backward: gated (two inputs) or plain, ReLU's from its kept output.
    fn backward_activation(&mut self, i: usize, g: &Tensor) -> Result<()> {
        if self.flow.inputs[i].len() == 2 {
            let (dg, du) = ops::gated_bwd(self.act, g, &self.input(i, 0), &self.input(i, 1));
            let ins = self.flow.inputs[i].clone();
            self.add_act_grad(ins[0], dg);
            self.add_act_grad(ins[1], du);
        } else {
            let kept = if self.act == Activation::Relu {
                self.outs[i]
                    .as_ref()
                    .map(|h| h.t.shallow_clone())
                    .ok_or_else(|| ExecError::Unsupported("ReLU output not kept".into()))?
            } else {
                self.input(i, 0)
            };
            let dx = ops::act_bwd(self.act, g, &kept);
            self.add_act_grad(self.flow.inputs[i][0], dx);
        }
        Ok(())
    }
}
