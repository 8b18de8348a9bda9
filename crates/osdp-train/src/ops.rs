//! Forward and backward of each operator kind, written with libtorch kernels and no autograd:
//! the executor decides which tensors live between forward and backward, so every backward
//! here takes exactly what its forward returned for saving. Activations are `[batch, seq, width]`.

use tch::{Kind, Tensor};

use osdp_core::model::Activation;

/// `y = x Wᵀ` for one column slice of a linear's weight (`x` narrowed to the same columns).
/// A weight [`gemm_rows`] pads is multiplied with zero rows added, and `y` is the first `out`
/// columns of the padded product (a view: its rows keep the padded stride). Also the rows the
/// weight was padded to, where it was: what ran, for the executor to report.
pub fn linear_fwd(x: &Tensor, w: &Tensor) -> (Tensor, Option<i64>) {
    match gemm_rows(w) {
        Some(rows) => (linear_fwd_padded(x, w, rows), Some(rows)),
        None => (linear_fwd_plain(x, w), None),
    }
}

/// Gradients of [`linear_fwd`]: `(dx, dW)`, padded as its forward was, and the rows padded to.
pub fn linear_bwd(dy: &Tensor, x: &Tensor, w: &Tensor) -> ((Tensor, Tensor), Option<i64>) {
    match gemm_rows(w) {
        Some(rows) => (linear_bwd_padded(dy, x, w, rows), Some(rows)),
        None => (linear_bwd_plain(dy, x, w), None),
    }
}

/// [`linear_fwd`] on the weight as it is, padded or not (`calibrate` times cuBLAS so).
pub fn linear_fwd_plain(x: &Tensor, w: &Tensor) -> Tensor {
    x.matmul(&w.tr())
}

/// [`linear_bwd`] on the weight as it is.
pub fn linear_bwd_plain(dy: &Tensor, x: &Tensor, w: &Tensor) -> (Tensor, Tensor) {
    let out = w.size()[0];
    let cols = w.size()[1];
    let dx = dy.matmul(w);
    let dw = dy.reshape([-1, out]).tr().mm(&x.reshape([-1, cols]));
    (dx, dw)
}

/// The rows a linear's `[out, in]` weight is multiplied with, where not its own: a 16-bit
/// weight on a GPU whose `out` is not a multiple of 8 sends all three of the linear's GEMMs to
/// cuBLAS's slow kernels (GPT-2's 50,257-row head at 12 % of peak on the H200 of 2026-11-28:
/// docs/fidelity.md). With zero rows up to a multiple of 64 every GEMM dimension is aligned,
/// for two copies of the weight and one of the output's gradient a step. Only where the zero
/// rows add under 1 % (the heads of large vocabularies), so no output grows by more; off with
/// `OSDP_GEMM_PADDING=0`.
pub fn gemm_rows(w: &Tensor) -> Option<i64> {
    if !pads_on(w.device(), w.kind()) {
        return None;
    }
    osdp_core::cost::padded_weight_rows(&w.size())
}

/// Whether [`gemm_rows`] pads weights of `kind` on `device` at all: 16-bit ones on a GPU,
/// unless `OSDP_GEMM_PADDING=0`.
pub fn pads_on(device: tch::Device, kind: Kind) -> bool {
    match crate::env::gemm_padding() {
        crate::env::GemmPadding::Off => false,
        crate::env::GemmPadding::Gpu => {
            device.is_cuda() && matches!(kind, Kind::BFloat16 | Kind::Half)
        }
        crate::env::GemmPadding::Everywhere => true,
    }
}

/// [`linear_fwd`] with `w` padded to `rows` rows.
pub fn linear_fwd_padded(x: &Tensor, w: &Tensor, rows: i64) -> Tensor {
    let out = w.size()[0];
    let padded = w.constant_pad_nd([0, 0, 0, rows - out]);
    x.matmul(&padded.tr()).narrow(-1, 0, out)
}

/// [`linear_bwd`] with `w` and `dy` padded to `rows`: `dW` is the first `out` rows of the
/// padded weight's gradient (a contiguous view).
pub fn linear_bwd_padded(dy: &Tensor, x: &Tensor, w: &Tensor, rows: i64) -> (Tensor, Tensor) {
    let (out, cols) = (w.size()[0], w.size()[1]);
    let padded = w.constant_pad_nd([0, 0, 0, rows - out]);
    let dy = dy.constant_pad_nd([0, rows - out]);
    let dx = dy.matmul(&padded);
    let dw = dy
        .reshape([-1, rows])
        .tr()
        .mm(&x.reshape([-1, cols]))
        .narrow(0, 0, out);
    (dx, dw)
}

/// Sum of `dy` over every dimension but the last: the bias gradient.
pub fn bias_grad(dy: &Tensor) -> Tensor {
    let width = *dy.size().last().unwrap_or(&1);
    dy.reshape([-1, width]).sum_dim_intlist(0, false, dy.kind())
}

/// Layer norm over the last dimension: `(y, mean, rstd)`.
pub fn layer_norm_fwd(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    eps: f64,
) -> (Tensor, Tensor, Tensor) {
    let width = *x.size().last().unwrap_or(&1);
    x.native_layer_norm([width], Some(w), b, eps)
}

/// Set once a norm's backward kernel has failed on the GPU (and said so).
static NORM_KERNEL_FAILED: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// The precision a norm's backward computes in: fp32 for 16-bit inputs, else their own.
fn accumulation_kind(kind: Kind) -> Kind {
    match kind {
        Kind::BFloat16 | Kind::Half => Kind::Float,
        k => k,
    }
}

/// Gradients of [`layer_norm_fwd`]: `(dx, dw, db)`, all in `dy`'s dtype. The statistics may
/// come in another precision than the activations (on CUDA, `native_layer_norm` returns fp32
/// mean and rstd for bf16 input; on the CPU, bf16): the arithmetic runs in fp32 for 16-bit
/// inputs either way, so the next op never meets mixed dtypes.
///
/// On CUDA libtorch's backward kernel does it ([`crate::aten::layer_norm_backward`]); should it
/// fail, autograd over the forward ([`norm_bwd_fused`]), with `eps`.
pub fn layer_norm_bwd(
    dy: &Tensor,
    x: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    w: &Tensor,
    eps: f64,
) -> (Tensor, Tensor, Tensor) {
    let out = dy.kind();
    if dy.device().is_cuda() {
        let (dx, dw) =
            crate::aten::layer_norm_backward(dy, x, mean, rstd, w).unwrap_or_else(|err| {
                crate::aten::warn_fallback(&NORM_KERNEL_FAILED, &err);
                layer_norm_bwd_fused(dy, x, w, eps)
            });
        return (dx.to_kind(out), dw.to_kind(out), bias_grad(dy));
    }
    let acc = accumulation_kind(out);
    let (dy, x, mean, rstd, w) = (
        dy.to_kind(acc),
        x.to_kind(acc),
        mean.to_kind(acc),
        rstd.to_kind(acc),
        w.to_kind(acc),
    );
    let xhat = (&x - &mean) * &rstd;
    let dxhat = &dy * &w;
    let c1 = dxhat.mean_dim(-1, true, acc);
    let c2 = (&dxhat * &xhat).mean_dim(-1, true, acc);
    let dx = (dxhat - c1 - &xhat * c2) * &rstd;
    let dw = bias_grad(&(&dy * xhat));
    let db = bias_grad(&dy);
    (dx.to_kind(out), dw.to_kind(out), db.to_kind(out))
}

/// RMS norm over the last dimension: `(y, rstd)`; on CUDA libtorch's fused kernel (rstd in
/// fp32), whose own backward kernel [`rms_norm_bwd`] then uses.
pub fn rms_norm_fwd(x: &Tensor, w: &Tensor, eps: f64) -> (Tensor, Tensor) {
    if x.device().is_cuda() {
        let width = *x.size().last().unwrap_or(&1);
        match x.f_internal_fused_rms_norm([width], Some(w), eps) {
            Ok(out) => return out,
            Err(err) => crate::aten::warn_fallback(&NORM_KERNEL_FAILED, &err.to_string()),
        }
    }
    let rstd = ((x * x).mean_dim(-1, true, x.kind()) + eps).rsqrt();
    let y = x * &rstd * w;
    (y, rstd)
}

/// Gradients of [`rms_norm_fwd`]: `(dx, dw)` in `dy`'s dtype, computed in fp32 for 16-bit
/// inputs as [`layer_norm_bwd`] is; on CUDA by libtorch's fused kernels, with `eps`.
pub fn rms_norm_bwd(
    dy: &Tensor,
    x: &Tensor,
    rstd: &Tensor,
    w: &Tensor,
    eps: f64,
) -> (Tensor, Tensor) {
    let out = dy.kind();
    if dy.device().is_cuda() {
        let (dx, dw) = crate::aten::rms_norm_backward(dy, x, rstd, w).unwrap_or_else(|err| {
            crate::aten::warn_fallback(&NORM_KERNEL_FAILED, &err);
            rms_norm_bwd_fused(dy, x, w, eps)
        });
        return (dx.to_kind(out), dw.to_kind(out));
    }
    let acc = accumulation_kind(out);
    let (dy, x, rstd, w) = (
        dy.to_kind(acc),
        x.to_kind(acc),
        rstd.to_kind(acc),
        w.to_kind(acc),
    );
    let xhat = &x * &rstd;
    let dxhat = &dy * &w;
    let c = (&dxhat * &xhat).mean_dim(-1, true, acc);
    let dx = (dxhat - &xhat * c) * &rstd;
    let dw = bias_grad(&(&dy * xhat));
    (dx.to_kind(out), dw.to_kind(out))
}

/// A norm's `(dx, dw)` by libtorch's own kernels: `forward` run again under autograd on leaves
/// of `x` and `w`, then the backward of `Σ y·dy` (whose gradient with respect to `y` is `dy`).
/// A few passes over the activations in their own precision (the fused backward accumulates in
/// fp32 inside) where the arithmetic of [`layer_norm_bwd`] takes a dozen over fp32 copies: on a
/// GPU the difference is several-fold (docs/benchmarks.md, the first H100).
pub fn norm_bwd_fused(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    forward: impl Fn(&Tensor, &Tensor) -> Tensor,
) -> (Tensor, Tensor) {
    tch::with_grad(|| {
        let (xl, wl) = (
            x.detach().set_requires_grad(true),
            w.detach().set_requires_grad(true),
        );
        let total = (forward(&xl, &wl) * dy).sum(accumulation_kind(dy.kind()));
        let mut g = Tensor::run_backward(&[total], &[&xl, &wl], false, false).into_iter();
        let dx = g.next().unwrap_or_else(|| x.zeros_like());
        let dw = g.next().unwrap_or_else(|| w.zeros_like());
        (dx, dw)
    })
}

/// [`norm_bwd_fused`] of a layer norm (its bias only shifts `y`: its gradient is `Σ dy`).
pub fn layer_norm_bwd_fused(dy: &Tensor, x: &Tensor, w: &Tensor, eps: f64) -> (Tensor, Tensor) {
    let width = *x.size().last().unwrap_or(&1);
    norm_bwd_fused(dy, x, w, |x, w| {
        x.layer_norm([width], Some(w), None::<&Tensor>, eps, true)
    })
}

/// [`norm_bwd_fused`] of an RMS norm.
pub fn rms_norm_bwd_fused(dy: &Tensor, x: &Tensor, w: &Tensor, eps: f64) -> (Tensor, Tensor) {
    let width = *x.size().last().unwrap_or(&1);
    norm_bwd_fused(dy, x, w, |x, w| x.rms_norm([width], Some(w), eps))
}

/// The model's activation function.
pub fn act_fwd(act: Activation, x: &Tensor) -> Tensor {
    match act {
        Activation::Gelu => x.gelu("none"),
        Activation::GeluTanh => x.gelu("tanh"),
        Activation::Relu => x.relu(),
        Activation::Silu => x.silu(),
    }
}

/// `dy · act'(x)`; ReLU needs only its output `y`, which is what it keeps.
pub fn act_bwd(act: Activation, dy: &Tensor, x_or_y: &Tensor) -> Tensor {
    match act {
        Activation::Gelu => x_or_y.gelu_backward(dy, "none"),
        Activation::GeluTanh => x_or_y.gelu_backward(dy, "tanh"),
        Activation::Relu => dy * x_or_y.gt(0.0).to_kind(dy.kind()),
        Activation::Silu => x_or_y.silu_backward(dy),
    }
}

/// Gated MLP activation `act(gate) * up`.
pub fn gated_fwd(act: Activation, gate: &Tensor, up: &Tensor) -> Tensor {
    act_fwd(act, gate) * up
}

/// Gradients of [`gated_fwd`]: `(dgate, dup)`.
pub fn gated_bwd(act: Activation, dy: &Tensor, gate: &Tensor, up: &Tensor) -> (Tensor, Tensor) {
    let dup = dy * act_fwd(act, gate);
    let dgate = match act {
        // ReLU's derivative from its input: the gate, which is what a gated op keeps.
        Activation::Relu => dy * up * gate.gt(0.0).to_kind(dy.kind()),
        _ => act_bwd(act, &(dy * up), gate),
    };
    (dgate, dup)
}

/// Rows `ids` of `w`: `[b, s] -> [b, s, dim]`.
pub fn embedding_fwd(w: &Tensor, ids: &Tensor) -> Tensor {
    let (b, s) = (ids.size()[0], ids.size()[1]);
    w.index_select(0, &ids.reshape([-1])).reshape([b, s, -1])
}

/// Gradient of [`embedding_fwd`] with respect to the table (`rows` rows).
pub fn embedding_bwd(dy: &Tensor, ids: &Tensor, rows: i64) -> Tensor {
    let dim = *dy.size().last().unwrap_or(&1);
    let grad = Tensor::zeros([rows, dim], (dy.kind(), dy.device()));
    grad.index_add(0, &ids.reshape([-1]), &dy.reshape([-1, dim]))
}

/// What attention needs to know about the model.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub heads: i64,
    pub kv_heads: i64,
    pub head_dim: i64,
    pub causal: bool,
    /// Rotary base when the model rotates queries and keys.
    pub rope_theta: Option<f64>,
}

/// Rotary tables `(cos, sin)`, `[seq, head_dim]`, in the half-split convention.
pub fn rope_tables(seq: i64, head_dim: i64, theta: f64, device: tch::Device) -> (Tensor, Tensor) {
    let opts = (Kind::Float, device);
    let idx = Tensor::arange_start_step(0, head_dim, 2, opts) / head_dim as f64;
    let inv_freq = Tensor::from(theta).to_device(device).pow(&idx).reciprocal();
    let pos = Tensor::arange(seq, opts);
    let freqs = pos.unsqueeze(1) * inv_freq.unsqueeze(0);
    let emb = Tensor::cat(&[&freqs, &freqs], -1);
    (emb.cos(), emb.sin())
}

fn rotate_half(x: &Tensor) -> Tensor {
    let half = x.size().last().copied().unwrap_or(0) / 2;
    let x1 = x.narrow(-1, 0, half);
    let x2 = x.narrow(-1, half, half);
    Tensor::cat(&[&x2.neg(), &x1], -1)
}

/// Rotate `x` (`[b, heads, s, d]`) by the rotary angles; `inverse` applies the transpose, which
/// is the backward of the rotation.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, inverse: bool) -> Tensor {
    let kind = x.kind();
    let (cos, sin) = (cos.to_kind(kind), sin.to_kind(kind));
    if inverse {
        x * &cos - rotate_half(&(x * &sin))
    } else {
        x * &cos + rotate_half(x) * &sin
    }
}

/// `[b, s, heads·d] -> [b, heads, s, d]`: on CUDA a strided view (the fused attention kernels
/// read it as it is, as PyTorch's own `view(…).transpose(1, 2)` hands it to them), elsewhere a
/// contiguous copy.
fn heads_first(x: &Tensor, heads: i64, d: i64) -> Tensor {
    let (b, s) = (x.size()[0], x.size()[1]);
    let view = x.reshape([b, s, heads, d]).transpose(1, 2);
    if x.device().is_cuda() {
        view
    } else {
        view.contiguous()
    }
}

/// `[b, heads, s, d] -> [b, s, heads·d]`.
fn heads_last(x: &Tensor) -> Tensor {
    let sz = x.size();
    x.transpose(1, 2)
        .contiguous()
        .reshape([sz[0], sz[2], sz[1] * sz[3]])
}

/// Split attention inputs into `q`, `k`, `v` in `[b, s, ·]` form: one fused `qkv` input (q, k
/// and v side by side) or three separate ones.
pub fn split_qkv(inputs: &[&Tensor], a: &AttentionShape) -> (Tensor, Tensor, Tensor) {
    if inputs.len() == 1 {
        let qw = a.heads * a.head_dim;
        let kw = a.kv_heads * a.head_dim;
        let x = inputs[0];
        (
            x.narrow(-1, 0, qw),
            x.narrow(-1, qw, kw),
            x.narrow(-1, qw + kw, kw),
        )
    } else {
        (
            inputs[0].shallow_clone(),
            inputs[1].shallow_clone(),
            inputs[2].shallow_clone(),
        )
    }
}

/// Queries, keys and values ready for the kernel: heads first, rotated, keys and values repeated
/// for grouped-query attention.
fn prepare(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    a: &AttentionShape,
    rope_cs: Option<&(Tensor, Tensor)>,
) -> (Tensor, Tensor, Tensor) {
    let mut q = heads_first(q, a.heads, a.head_dim);
    let mut k = heads_first(k, a.kv_heads, a.head_dim);
    let mut v = heads_first(v, a.kv_heads, a.head_dim);
    if let Some((cos, sin)) = rope_cs {
        q = rope(&q, cos, sin, false);
        k = rope(&k, cos, sin, false);
    }
    if a.kv_heads != a.heads {
        let g = a.heads / a.kv_heads;
        k = k.repeat_interleave_self_int(g, 1, None);
        v = v.repeat_interleave_self_int(g, 1, None);
    }
    (q, k, v)
}

/// Attention core with libtorch's fused kernels: `(out [b, s, heads·d], what backward needs)`.
/// On CPU the flash kernel (saves the log-sum-exp). On CUDA PyTorch's own
/// `scaled_dot_product_attention`, which picks the fastest kernel the GPU has (flash attention
/// on Ampere and Hopper); it saves nothing: backward runs it again under autograd.
pub fn attention_fwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    a: &AttentionShape,
    rope_cs: Option<&(Tensor, Tensor)>,
) -> (Tensor, Vec<Tensor>) {
    let (q, k, v) = prepare(q, k, v, a, rope_cs);
    let scale = 1.0 / (a.head_dim as f64).sqrt();
    if q.device().is_cuda() {
        return (heads_last(&sdpa(&q, &k, &v, a, scale)), Vec::new());
    }
    let (out, lse) = Tensor::internal_scaled_dot_product_flash_attention_for_cpu(
        &q,
        &k,
        &v,
        0.0,
        a.causal,
        None::<Tensor>,
        scale,
    );
    (heads_last(&out), vec![lse])
}

/// PyTorch's `scaled_dot_product_attention` on heads-first `q`, `k`, `v`: the CUDA attention
/// core, forward and (under autograd) backward.
fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor, a: &AttentionShape, scale: f64) -> Tensor {
    Tensor::scaled_dot_product_attention(q, k, v, None::<Tensor>, 0.0, a.causal, scale, false)
}

/// The CUDA attention core's gradients: its forward again on leaves that require grad, then
/// autograd's backward of `Σ out · dout` (whose gradient with respect to `out` is `dout`).
fn attention_bwd_autograd(
    douth: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    a: &AttentionShape,
    scale: f64,
) -> (Tensor, Tensor, Tensor) {
    tch::with_grad(|| {
        let leaf = |x: &Tensor| x.detach().set_requires_grad(true);
        let (q, k, v) = (leaf(q), leaf(k), leaf(v));
        let total = (sdpa(&q, &k, &v, a, scale) * douth).sum(Kind::Float);
        let mut g = Tensor::run_backward(&[total], &[&q, &k, &v], false, false).into_iter();
        let mut next = || g.next().unwrap_or_else(|| Tensor::zeros_like(&q));
        (next(), next(), next())
    })
}

/// Gradients of [`attention_fwd`] with respect to `q`, `k`, `v` (in `[b, s, ·]` form).
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd(
    dout: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    saved: &[Tensor],
    a: &AttentionShape,
    rope_cs: Option<&(Tensor, Tensor)>,
) -> (Tensor, Tensor, Tensor) {
    let (qh, kh, vh) = prepare(q, k, v, a, rope_cs);
    let scale = 1.0 / (a.head_dim as f64).sqrt();
    let douth = heads_first(dout, a.heads, a.head_dim);
    let (mut dq, mut dk, mut dv) = if q.device().is_cuda() && saved.is_empty() {
        attention_bwd_autograd(&douth, &qh, &kh, &vh, a, scale)
    } else {
        Tensor::internal_scaled_dot_product_flash_attention_for_cpu_backward(
            &douth,
            &qh,
            &kh,
            &vh,
            &heads_first(out, a.heads, a.head_dim),
            &saved[0],
            0.0,
            a.causal,
            None::<Tensor>,
            scale,
        )
    };
    if a.kv_heads != a.heads {
        let g = a.heads / a.kv_heads;
        let sz = dk.size();
        let grouped = [sz[0], a.kv_heads, g, sz[2], sz[3]];
        dk = dk.reshape(grouped).sum_dim_intlist(2, false, dk.kind());
        dv = dv.reshape(grouped).sum_dim_intlist(2, false, dv.kind());
    }
    if let Some((cos, sin)) = rope_cs {
        dq = rope(&dq, cos, sin, true);
        dk = rope(&dk, cos, sin, true);
    }
    (heads_last(&dq), heads_last(&dk), heads_last(&dv))
}

/// Logits turned into fp32 log-probabilities at a time (32 MiB of fp32): bounds the forward's
/// temporaries (the fp32 copy of a chunk its log-softmax reads) whatever the vocabulary.
pub const CE_CHUNK_ELEMENTS: i64 = 8 << 20;

/// Mean token cross-entropy: `(loss, log-probabilities kept for backward)`.
///
/// The log-probabilities are one fp32 `[tokens, vocab]` buffer, filled chunk by chunk in place:
/// `log_softmax(.., Float)` of bf16 logits would first make a whole fp32 copy of the logits,
/// and a large vocabulary makes that the step's largest tensor. What remains is the kept
/// buffer plus [`CE_CHUNK_ELEMENTS`] of temporaries.
pub fn cross_entropy_fwd(logits: &Tensor, labels: &Tensor) -> (Tensor, Tensor) {
    let vocab = *logits.size().last().unwrap_or(&1);
    let logits = logits.reshape([-1, vocab]);
    let rows = logits.size()[0];
    let acc = accumulation_kind(logits.kind());
    let logp = Tensor::empty([rows, vocab], (acc, logits.device()));
    let chunk_rows = (CE_CHUNK_ELEMENTS / vocab.max(1)).max(1);
    let mut start = 0;
    while start < rows {
        let n = chunk_rows.min(rows - start);
        // One log-softmax kernel per chunk, written into the kept buffer (a logsumexp and a
        // subtraction took several passes more: on the H200 of 2026-11-28 the loss was a
        // sixth of gpt2-medium's step time beside its linears).
        let chunk = logp.narrow(0, start, n);
        let _ = logits
            .narrow(0, start, n)
            .log_softmax_int_out(&chunk, -1, acc);
        start += n;
    }
    let picked = logp.gather(1, &labels.reshape([-1, 1]), false);
    let loss = picked.mean(acc).neg();
    (loss, logp)
}

/// Gradient of `scale · loss` with respect to the logits (`[b, s, vocab]`, in `kind`),
/// computed in place on the log-probabilities the forward kept (consumed here): no second
/// `[tokens, vocab]` fp32 buffer, only the gradient in the compute dtype.
pub fn cross_entropy_bwd(scale: f64, logp: Tensor, labels: &Tensor, kind: Kind) -> Tensor {
    let rows = logp.size()[0];
    let flat = labels.reshape([-1, 1]);
    let mut grad = logp;
    let _ = grad.exp_();
    let minus_one = Tensor::full([rows, 1], -1.0, (grad.kind(), grad.device()));
    let _ = grad.scatter_add_(1, &flat, &minus_one);
    let _ = grad.g_mul_scalar_(scale / rows as f64);
    let sz = labels.size();
    grad.reshape([sz[0], sz[1], -1]).to_kind(kind)
}

#[cfg(test)]
mod tests {
    //! Each backward against libtorch autograd on random inputs.
    use super::*;

    fn rand(shape: &[i64], seed: i64) -> Tensor {
        tch::manual_seed(seed);
        Tensor::randn(shape, (Kind::Double, tch::Device::Cpu))
    }

    fn leaf(t: &Tensor) -> Tensor {
        t.detach().set_requires_grad(true)
    }

    fn close(a: &Tensor, b: &Tensor) -> bool {
        let diff = (a - b).abs().max().double_value(&[]);
        let scale = b.abs().max().double_value(&[]).max(1.0);
        diff / scale < 1e-9
    }

    fn grad_of(t: &Tensor) -> Tensor {
        t.grad().detach()
    }

    #[test]
    fn linear_backward_matches_autograd_and_slices_add_up() {
        let (x, w, dy) = (rand(&[2, 3, 8], 1), rand(&[5, 8], 2), rand(&[2, 3, 5], 3));
        let (xl, wl) = (leaf(&x), leaf(&w));
        (xl.matmul(&wl.tr()) * &dy).sum(Kind::Double).backward();
        let ((dx, dw), _) = linear_bwd(&dy, &x, &w);
        assert!(close(&dx, &grad_of(&xl)));
        assert!(close(&dw, &grad_of(&wl)));
        // Two column slices give the same output and gradients as the whole weight.
        let y = linear_fwd(&x.narrow(-1, 0, 4), &w.narrow(1, 0, 4)).0
            + linear_fwd(&x.narrow(-1, 4, 4), &w.narrow(1, 4, 4)).0;
        assert!(close(&y, &linear_fwd(&x, &w).0));
        let ((dx1, dw1), _) = linear_bwd(&dy, &x.narrow(-1, 4, 4), &w.narrow(1, 4, 4));
        assert!(close(&dw1, &grad_of(&wl).narrow(1, 4, 4)));
        assert!(close(&dx1, &grad_of(&xl).narrow(-1, 4, 4)));
    }

    #[test]
    fn weights_are_padded_only_on_a_gpu_in_16_bits() {
        // On the CPU, and in fp32 anywhere, nothing is padded: GPT-2's head as it is.
        assert_eq!(
            gemm_rows(&rand(&[50_257, 2], 9).to_kind(Kind::BFloat16)),
            None
        );
        assert_eq!(gemm_rows(&rand(&[50_257, 2], 9)), None);
    }

    #[test]
    fn a_padded_linear_gives_the_unpadded_values_and_feeds_the_loss() {
        // 13 output rows computed as 64: the values are the plain product's, the output is a
        // view whose rows keep the padded stride, and the loss reads it as it would a copy.
        let (x, w, dy) = (
            rand(&[2, 3, 8], 11),
            rand(&[13, 8], 12),
            rand(&[2, 3, 13], 13),
        );
        let y = linear_fwd_padded(&x, &w, 64);
        assert_eq!(y.size(), [2, 3, 13]);
        assert_eq!(y.stride()[1], 64);
        assert!(close(&y, &x.matmul(&w.tr())));
        let labels = Tensor::from_slice(&[0i64, 12, 3, 7, 1, 2]).reshape([2, 3]);
        let (loss, _) = cross_entropy_fwd(&y, &labels);
        let (plain, _) = cross_entropy_fwd(&y.contiguous(), &labels);
        assert!((loss.double_value(&[]) - plain.double_value(&[])).abs() < 1e-12);

        let (dx, dw) = linear_bwd_padded(&dy, &x, &w, 64);
        let (dx0, dw0) = linear_bwd_plain(&dy, &x, &w);
        assert!(close(&dx, &dx0));
        assert!(close(&dw, &dw0));
        assert_eq!(dw.size(), [13, 8]);
        assert!(
            dw.is_contiguous(),
            "the weight's gradient is handed on as a whole tensor"
        );
    }

    #[test]
    fn norm_backwards_match_autograd() {
        let (x, w, b, dy) = (
            rand(&[2, 3, 16], 4),
            rand(&[16], 5),
            rand(&[16], 6),
            rand(&[2, 3, 16], 7),
        );
        let (xl, wl, bl) = (leaf(&x), leaf(&w), leaf(&b));
        (xl.layer_norm([16], Some(&wl), Some(&bl), 1e-5, false) * &dy)
            .sum(Kind::Double)
            .backward();
        let (y, mean, rstd) = layer_norm_fwd(&x, &w, Some(&b), 1e-5);
        assert!(close(
            &y,
            &x.layer_norm([16], Some(&w), Some(&b), 1e-5, false)
        ));
        let (dx, dw, db) = layer_norm_bwd(&dy, &x, &mean, &rstd, &w, 1e-5);
        assert!(close(&dx, &grad_of(&xl)));
        assert!(close(&dw, &grad_of(&wl)));
        assert!(close(&db, &grad_of(&bl)));

        let (xl, wl) = (leaf(&x), leaf(&w));
        let (y, rstd) = rms_norm_fwd(&xl, &wl, 1e-5);
        (&y * &dy).sum(Kind::Double).backward();
        assert!(close(&y.detach(), &x.rms_norm([16], Some(&w), 1e-5)));
        let (dx, dw) = rms_norm_bwd(&dy, &x, &rstd.detach(), &w, 1e-5);
        assert!(close(&dx, &grad_of(&xl)));
        assert!(close(&dw, &grad_of(&wl)));
    }

    /// The CUDA path's norm backwards (libtorch's fused kernels under autograd) give what the
    /// CPU's arithmetic gives: same shapes, same gradients, the layer norm's bias left out.
    #[test]
    fn fused_norm_backwards_equal_the_written_out_ones() {
        let (x, w, b, dy) = (
            rand(&[2, 3, 16], 11),
            rand(&[16], 12),
            rand(&[16], 13),
            rand(&[2, 3, 16], 14),
        );
        let (_, mean, rstd) = layer_norm_fwd(&x, &w, Some(&b), 1e-5);
        let (dx, dw, _) = layer_norm_bwd(&dy, &x, &mean, &rstd, &w, 1e-5);
        let (fdx, fdw) = layer_norm_bwd_fused(&dy, &x, &w, 1e-5);
        assert!(close(&fdx, &dx) && close(&fdw, &dw));
        let (_, rstd) = rms_norm_fwd(&x, &w, 1e-5);
        let (dx, dw) = rms_norm_bwd(&dy, &x, &rstd, &w, 1e-5);
        let (fdx, fdw) = rms_norm_bwd_fused(&dy, &x, &w, 1e-5);
        assert!(close(&fdx, &dx) && close(&fdw, &dw));
        // Under the executor's no-grad mode too, which is where it runs.
        let _guard = tch::no_grad_guard();
        let (gdx, _) = rms_norm_bwd_fused(&dy, &x, &w, 1e-5);
        assert!(close(&gdx, &dx));
    }

    #[test]
    fn activation_backwards_match_autograd() {
        let (x, u, dy) = (
            rand(&[2, 3, 6], 8),
            rand(&[2, 3, 6], 9),
            rand(&[2, 3, 6], 10),
        );
        for act in [
            Activation::Gelu,
            Activation::GeluTanh,
            Activation::Relu,
            Activation::Silu,
        ] {
            let xl = leaf(&x);
            (act_fwd(act, &xl) * &dy).sum(Kind::Double).backward();
            let kept = if act == Activation::Relu {
                act_fwd(act, &x)
            } else {
                x.shallow_clone()
            };
            assert!(close(&act_bwd(act, &dy, &kept), &grad_of(&xl)), "{act:?}");

            let (gl, ul) = (leaf(&x), leaf(&u));
            (gated_fwd(act, &gl, &ul) * &dy)
                .sum(Kind::Double)
                .backward();
            let (dg, du) = gated_bwd(act, &dy, &x, &u);
            assert!(close(&dg, &grad_of(&gl)), "gated {act:?}");
            assert!(close(&du, &grad_of(&ul)), "gated {act:?}");
        }
    }

    #[test]
    fn embedding_backward_matches_autograd_with_repeated_ids() {
        let w = rand(&[10, 4], 11);
        let ids = Tensor::from_slice(&[1i64, 3, 3, 9, 1, 1]).reshape([2, 3]);
        let dy = rand(&[2, 3, 4], 12);
        let wl = leaf(&w);
        (embedding_fwd(&wl, &ids) * &dy)
            .sum(Kind::Double)
            .backward();
        assert!(close(&embedding_bwd(&dy, &ids, 10), &grad_of(&wl)));
    }

    fn check_attention(a: AttentionShape, fused: bool, seed: i64) {
        let (b, s) = (2, 6);
        let qw = a.heads * a.head_dim;
        let kw = a.kv_heads * a.head_dim;
        let rope_cs = a
            .rope_theta
            .map(|t| rope_tables(s, a.head_dim, t, tch::Device::Cpu));
        let rope_cs = rope_cs
            .as_ref()
            .map(|(c, s)| (c.to_kind(Kind::Double), s.to_kind(Kind::Double)));
        let dy = rand(&[b, s, qw], seed);
        let (q, k, v) = if fused {
            let x = rand(&[b, s, qw + 2 * kw], seed + 1);
            (
                x.narrow(-1, 0, qw),
                x.narrow(-1, qw, kw),
                x.narrow(-1, qw + kw, kw),
            )
        } else {
            (
                rand(&[b, s, qw], seed + 1),
                rand(&[b, s, kw], seed + 2),
                rand(&[b, s, kw], seed + 3),
            )
        };
        // Reference: plain attention written with autograd-tracked ops.
        let (ql, kl, vl) = (leaf(&q), leaf(&k), leaf(&v));
        let (qh, kh, vh) = prepare(&ql, &kl, &vl, &a, rope_cs.as_ref());
        let mut scores = qh.matmul(&kh.transpose(-2, -1)) / (a.head_dim as f64).sqrt();
        if a.causal {
            let mask = Tensor::ones([s, s], (Kind::Bool, tch::Device::Cpu)).triu(1);
            scores = scores.masked_fill(&mask, f64::NEG_INFINITY);
        }
        let reference = heads_last(&scores.softmax(-1, Kind::Double).matmul(&vh));
        (&reference * &dy).sum(Kind::Double).backward();

        let (out, saved) = attention_fwd(&q, &k, &v, &a, rope_cs.as_ref());
        assert!(close(&out, &reference.detach()));
        let (dq, dk, dv) = attention_bwd(&dy, &q, &k, &v, &out, &saved, &a, rope_cs.as_ref());
        assert!(close(&dq, &grad_of(&ql)));
        assert!(close(&dk, &grad_of(&kl)));
        assert!(close(&dv, &grad_of(&vl)));
    }

    #[test]
    fn attention_backward_matches_autograd() {
        let gpt = AttentionShape {
            heads: 2,
            kv_heads: 2,
            head_dim: 4,
            causal: true,
            rope_theta: None,
        };
        check_attention(gpt, true, 20);
        let llama = AttentionShape {
            heads: 4,
            kv_heads: 2,
            head_dim: 4,
            causal: true,
            rope_theta: Some(10000.0),
        };
        check_attention(llama, false, 30);
        let encoder = AttentionShape {
            causal: false,
            ..gpt
        };
        check_attention(encoder, false, 40);
    }

    #[test]
    fn rope_inverse_undoes_the_rotation() {
        let (cos, sin) = rope_tables(5, 8, 10000.0, tch::Device::Cpu);
        let (cos, sin) = (cos.to_kind(Kind::Double), sin.to_kind(Kind::Double));
        let x = rand(&[1, 2, 5, 8], 50);
        let back = rope(&rope(&x, &cos, &sin, false), &cos, &sin, true);
        // The tables are fp32, so cos² + sin² is 1 to fp32 precision.
        let diff = (&back - &x).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "{diff}");
        assert!(
            (&rope(&x, &cos, &sin, false) - &x)
                .abs()
                .max()
                .double_value(&[])
                > 0.1
        );
    }

    #[test]
    fn cross_entropy_backward_matches_autograd() {
        let logits = rand(&[2, 3, 7], 60);
        let labels = Tensor::from_slice(&[0i64, 6, 3, 3, 1, 2]).reshape([2, 3]);
        let ll = leaf(&logits);
        let reference = ll
            .reshape([-1, 7])
            .cross_entropy_for_logits(&labels.reshape([-1]));
        (&reference * 0.5).backward();
        let (loss, logp) = cross_entropy_fwd(&logits, &labels);
        assert!((loss.double_value(&[]) - reference.double_value(&[])).abs() < 1e-6);
        let d = cross_entropy_bwd(0.5, logp, &labels, Kind::Double);
        // tch's cross_entropy_for_logits takes its log-softmax in fp32: compare at fp32.
        let diff = (d - grad_of(&ll)).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "{diff}");
    }

    #[test]
    fn cross_entropy_of_bf16_logits_keeps_fp32_log_probs_over_chunk_boundaries() {
        // More rows than one chunk, so the chunked fill is exercised at its seams.
        let vocab = 1 << 19;
        let rows = 2 * (CE_CHUNK_ELEMENTS / vocab) + 3;
        let logits = rand(&[1, rows, vocab], 61).to_kind(Kind::BFloat16);
        tch::manual_seed(62);
        let labels = Tensor::randint(vocab, [1, rows], (Kind::Int64, tch::Device::Cpu));
        let (loss, logp) = cross_entropy_fwd(&logits, &labels);
        assert_eq!(
            logp.kind(),
            Kind::Float,
            "log-probabilities are kept in fp32"
        );
        let reference = logits.reshape([-1, vocab]).log_softmax(-1, Kind::Float);
        let diff = (&logp - &reference).abs().max().double_value(&[]);
        // Log-probabilities near −ln(2¹⁹) ≈ −13 carry fp32's ~1e-7 relative rounding.
        assert!(diff < 1e-4, "chunked log-softmax differs by {diff}");
        let ref_loss = reference
            .gather(1, &labels.reshape([-1, 1]), false)
            .mean(Kind::Float)
            .neg();
        assert!((loss.double_value(&[]) - ref_loss.double_value(&[])).abs() < 1e-5);
        let d = cross_entropy_bwd(1.0, logp, &labels, Kind::BFloat16);
        assert_eq!(
            d.kind(),
            Kind::BFloat16,
            "the gradient is in the compute dtype"
        );
        assert_eq!(d.size(), vec![1, rows, vocab]);
    }

    #[test]
    fn norm_backwards_take_fp32_statistics_with_bf16_activations() {
        // What CUDA's native_layer_norm returns for bf16 input: fp32 mean and rstd.
        let (x, w, dy) = (
            rand(&[2, 3, 16], 63),
            rand(&[16], 64),
            rand(&[2, 3, 16], 65),
        );
        let (xb, wb, dyb) = (
            x.to_kind(Kind::BFloat16),
            w.to_kind(Kind::BFloat16),
            dy.to_kind(Kind::BFloat16),
        );
        let (_, mean, rstd) =
            layer_norm_fwd(&x.to_kind(Kind::Float), &w.to_kind(Kind::Float), None, 1e-5);
        assert_eq!(mean.kind(), Kind::Float);
        let (dx, dw, db) = layer_norm_bwd(&dyb, &xb, &mean, &rstd, &wb, 1e-5);
        for g in [&dx, &dw, &db] {
            assert_eq!(g.kind(), Kind::BFloat16, "gradients come in dy's dtype");
        }
        // The next linear's backward takes dx as it comes: no mixed-dtype matmul.
        let x_prev = rand(&[2, 3, 8], 66).to_kind(Kind::BFloat16);
        let w_prev = rand(&[16, 8], 67).to_kind(Kind::BFloat16);
        let ((dx_prev, dw_prev), _) = linear_bwd(&dx, &x_prev, &w_prev);
        assert_eq!(
            (dx_prev.kind(), dw_prev.kind()),
            (Kind::BFloat16, Kind::BFloat16)
        );
        // And they agree with the fp64 gradients to bf16 precision.
        let (xl, wl) = (leaf(&x), leaf(&w));
        (xl.layer_norm([16], Some(&wl), None::<&Tensor>, 1e-5, false) * &dy)
            .sum(Kind::Double)
            .backward();
        let rel = |a: &Tensor, b: &Tensor| {
            (a.to_kind(Kind::Double) - b).abs().max().double_value(&[])
                / b.abs().max().double_value(&[]).max(1.0)
        };
        assert!(
            rel(&dx, &grad_of(&xl)) < 2e-2,
            "dx off by {}",
            rel(&dx, &grad_of(&xl))
        );
        assert!(
            rel(&dw, &grad_of(&wl)) < 2e-2,
            "dw off by {}",
            rel(&dw, &grad_of(&wl))
        );
        let (_, rstd) = rms_norm_fwd(&x.to_kind(Kind::Float), &w.to_kind(Kind::Float), 1e-5);
        let (dx, dw) = rms_norm_bwd(&dyb, &xb, &rstd, &wb, 1e-5);
        assert_eq!((dx.kind(), dw.kind()), (Kind::BFloat16, Kind::BFloat16));
    }
}
