//! One training step on one rank: its rows run as micro-batches (forward, then backward op by
//! op in reverse with recomputed blocks re-run first), the gradients accumulated, then the
//! optimizer once and the loss averaged over the ranks.

use tch::{Kind, Tensor};

use super::{nbytes, ops, ExecError, Executor, Profile, Result, StepOutcome};
use crate::data::Batch;
use crate::memory::Category;
use osdp_core::model::OpKind;

impl Executor {
    /// One training step on this rank's share of the global batch: forward, backward,
    /// gradient synchronisation, clipping and the AdamW update.
    /// One optimizer step over `batch` (this rank's rows): the rows run as micro-batches of
    /// the plan's size, gradients accumulated as the strategies do (dp and zero1 keep full
    /// gradients and sync them once; zero2 and zero3 reduce-scatter every micro-batch; zero3
    /// gathers for every micro-batch), then one AdamW update.
    pub fn train_step(&mut self, batch: &Batch) -> Result<StepOutcome> {
        // A step smaller than one planned micro-batch runs as one (it holds less than planned).
        let micro = self.micro_batch.min(batch.rows.max(1));
        if batch.rows % micro != 0 {
            return Err(ExecError::Unsupported(format!(
                "{} samples per rank is not a whole number of micro-batches of {micro}",
                batch.rows
            )));
        }
        let accumulation = batch.rows / micro;
        let shape = [batch.rows as i64, batch.seq as i64];
        let ids = Tensor::from_slice(&batch.inputs)
            .reshape(shape)
            .to_device(self.device);
        let labels = Tensor::from_slice(&batch.labels)
            .reshape(shape)
            .to_device(self.device);
        let n = self.model.ops.len();
        let step_t0 = self.clock();
        if let Some(p) = self.profile.as_mut() {
            *p = Profile {
                fwd_s: vec![0.0; n],
                bwd_s: vec![0.0; n],
                fwd_coll_s: vec![0.0; n],
                bwd_coll_s: vec![0.0; n],
                ..Profile::default()
            };
        }
        self.ledger.reset_peak();
        let t0 = self.clock();
        self.allocate_grads();
        let alloc_s = self.since(t0);
        // Each micro-batch's loss is its tokens' mean: scaled by 1/(ranks × micro-batches),
        // the accumulated gradients are those of the mean over the whole global batch.
        let scale = 1.0 / (self.comm.world() * accumulation) as f64;
        let mut loss_sum = Tensor::zeros([], (Kind::Double, self.device));
        for k in 0..accumulation {
            let rows = (k * micro) as i64;
            self.ids = Some(ids.narrow(0, rows, micro as i64));
            self.labels = Some(labels.narrow(0, rows, micro as i64));
            let loss = self.forward_backward(scale)?;
            loss_sum += loss.to_kind(Kind::Double);
        }
        self.ids = None;
        self.labels = None;
        // Read once: a read per micro-batch would wait for the device each time.
        let local_loss = loss_sum.double_value(&[]) / accumulation as f64;

        let grad_norm = self.optimizer_step()?;
        let world = self.comm.world() as f64;
        let loss = self
            .comm
            .all_reduce(&Tensor::from(local_loss))?
            .double_value(&[])
            / world;
        let step_s = self.since(step_t0);
        if let Some(p) = self.profile.as_mut() {
            p.optimizer_s += alloc_s;
            p.step_s = step_s;
        }
        Ok(StepOutcome { loss, grad_norm })
    }

    /// Forward only over `batch` (one micro-batch of any size): its mean token loss and the
    /// logits the loss read (`[rows, seq, vocab]`, fp32 on the CPU). Nothing is kept after
    /// it and the weights are untouched: what `eval` runs.
    pub fn forward_only(&mut self, batch: &Batch) -> Result<(f64, Tensor)> {
        let shape = [batch.rows as i64, batch.seq as i64];
        self.ids = Some(
            Tensor::from_slice(&batch.inputs)
                .reshape(shape)
                .to_device(self.device),
        );
        self.labels = Some(
            Tensor::from_slice(&batch.labels)
                .reshape(shape)
                .to_device(self.device),
        );
        let n = self.model.ops.len();
        let ce = self
            .model
            .ops
            .iter()
            .position(|o| o.kind == OpKind::CrossEntropy)
            .ok_or_else(|| ExecError::Unsupported("the graph has no loss op".into()))?;
        let head = self.flow.inputs[ce][0];
        // Run up to the loss as a recomputation does, which holds every output it makes: the
        // head's output (the logits) stays for the loss computed here.
        let ran = tch::no_grad(|| self.forward_range(0..ce, false));
        let logits = self.outs[head].as_ref().map(|h| h.t.shallow_clone());
        for i in 0..n {
            self.drop_out(i);
            self.drop_extras(i);
        }
        let labels = self.labels.take();
        self.ids = None;
        ran?;
        let (Some(logits), Some(labels)) = (logits, labels) else {
            return Err(ExecError::Unsupported(
                "the head's output was not kept for the loss".into(),
            ));
        };
        let (loss, _) = ops::cross_entropy_fwd(&logits, &labels);
        Ok((
            loss.to_kind(Kind::Double).double_value(&[]),
            logits.to_kind(Kind::Float).to_device(tch::Device::Cpu),
        ))
    }

    /// Forward and backward of the micro-batch in `ids`/`labels`, adding its gradients (of
    /// `loss_scale` × its mean loss) to the step's; returns its mean loss.
    fn forward_backward(&mut self, loss_scale: f64) -> Result<Tensor> {
        let n = self.model.ops.len();
        // Nothing kept from a micro-batch that ended early (an error on its way).
        self.release_kept();
        let loss = self
            .forward_range(0..n, true)?
            .ok_or_else(|| ExecError::Unsupported("the graph has no loss op".into()))?;
        self.trace_forward_memory();
        for i in (0..n).rev() {
            if let Some(b) = self.flow.recomputed_block[i] {
                if self.flow.blocks.ops[b].last() == Some(&i) {
                    let first = self.flow.blocks.ops[b][0];
                    // The block's last op with parameters keeps what it gathers for its
                    // backward, which comes next, and a block that keeps keeps every weight
                    // it fetches whole (`Dataflow::keeps_gathered`).
                    self.keeping = true;
                    let ran = self.forward_range(first..i + 1, false);
                    self.keeping = false;
                    ran?;
                }
            }
            let g = if self.model.ops[i].kind == OpKind::CrossEntropy {
                Some(Tensor::from(loss_scale))
            } else {
                self.grads[i].take()
            };
            if let Some(g) = g {
                if self.model.ops[i].kind != OpKind::CrossEntropy {
                    self.ledger.sub(Category::Working, nbytes(&g));
                }
                let t0 = self.clock();
                let c0 = self.collectives_so_far();
                self.backward_op(i, &g)?;
                let dt = self.since(t0);
                if let Some(p) = self.profile.as_mut() {
                    p.bwd_s[i] += dt;
                    p.bwd_coll_s[i] += p.collective_s_since(c0);
                }
            }
            self.drop_extras(i);
            self.drop_out(i);
        }
        // Kept weights a backward did not take (an op no gradient reached): released.
        self.release_kept();
        Ok(loss)
    }
}
