//! libtorch kernels that tch does not bind, reached through a few lines of C++
//! (`src/aten_shim.cpp`): PyTorch's fused multi-tensor AdamW, the norm of a list of tensors, and
//! the layer and RMS norms' own backward kernels. On a GPU each replaces hundreds of small
//! kernel launches a step (docs/benchmarks.md, the H200 of 2026-11-28). A C++ exception comes
//! back as an `Err` with libtorch's message, never an abort, so callers fall back to their
//! written-out path.

use std::ffi::{c_char, c_int, CStr};

use tch::Tensor;
use torch_sys::C_tensor;

extern "C" {
    fn osdp_aten_last_error() -> *const c_char;
    fn osdp_fused_adamw(
        params: *const *mut C_tensor,
        grads: *const *mut C_tensor,
        m: *const *mut C_tensor,
        v: *const *mut C_tensor,
        n: i64,
        step: *const C_tensor,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        grad_scale: *const C_tensor,
    ) -> c_int;
    fn osdp_sum_of_squares(ts: *const *mut C_tensor, n: i64, out: *mut *mut C_tensor) -> c_int;
    fn osdp_layer_norm_backward(
        dy: *const C_tensor,
        x: *const C_tensor,
        mean: *const C_tensor,
        rstd: *const C_tensor,
        w: *const C_tensor,
        dx: *mut *mut C_tensor,
        dw: *mut *mut C_tensor,
    ) -> c_int;
    fn osdp_rms_norm_backward(
        dy: *const C_tensor,
        x: *const C_tensor,
        rstd: *const C_tensor,
        w: *const C_tensor,
        dx: *mut *mut C_tensor,
        dw: *mut *mut C_tensor,
    ) -> c_int;
}

/// libtorch's message for a call that returned 1 on this thread.
fn failed() -> String {
    // SAFETY: the shim returns a pointer into a thread-local string it keeps until the next
    // failing call on this thread.
    unsafe { CStr::from_ptr(osdp_aten_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn handles(ts: &[&Tensor]) -> Vec<*mut C_tensor> {
    ts.iter().map(|t| t.as_ptr() as *mut C_tensor).collect()
}

/// The AdamW hyper-parameters of one fused call.
#[derive(Clone, Copy, Debug)]
pub struct AdamW {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub weight_decay: f64,
    pub eps: f64,
}

/// One AdamW step of every `params[i]` in place, with its gradient `grads[i]` and moments
/// `m[i]`, `v[i]` (all fp32, contiguous, on one device): PyTorch's `_fused_adamw_`. `step` is a
/// one-element fp32 tensor on that device holding the step number already counted (the bias
/// corrections are `1 − βᵗ`); every gradient is divided by `grad_scale` first when given.
pub fn fused_adamw(
    params: &[&Tensor],
    grads: &[&Tensor],
    m: &[&Tensor],
    v: &[&Tensor],
    step: &Tensor,
    h: AdamW,
    grad_scale: Option<&Tensor>,
) -> Result<(), String> {
    let n = params.len();
    if grads.len() != n || m.len() != n || v.len() != n {
        return Err(format!(
            "fused AdamW: {n} parameters, {} gradients, {} and {} moments",
            grads.len(),
            m.len(),
            v.len()
        ));
    }
    if n == 0 {
        return Ok(());
    }
    let (p, g, m, v) = (handles(params), handles(grads), handles(m), handles(v));
    let scale = grad_scale.map_or(std::ptr::null(), |t| t.as_ptr());
    // SAFETY: every handle is a live tch tensor borrowed for the call; the shim copies the
    // `at::Tensor`s it needs (reference-counted) and mutates only their storage.
    let rc = unsafe {
        osdp_fused_adamw(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            n as i64,
            step.as_ptr(),
            h.lr,
            h.beta1,
            h.beta2,
            h.weight_decay,
            h.eps,
            scale,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(format!("fused AdamW: {}", failed()))
    }
}

/// `Σᵢ ‖tᵢ‖²` over the tensors, computed in fp32 with one multi-tensor kernel: a one-element
/// fp32 tensor on their device.
pub fn sum_of_squares(ts: &[&Tensor]) -> Result<Tensor, String> {
    let hs = handles(ts);
    let mut out: *mut C_tensor = std::ptr::null_mut();
    // SAFETY: as in `fused_adamw`; on success `out` is a new tensor the shim allocated, owned
    // from here by the returned `Tensor`.
    let rc = unsafe { osdp_sum_of_squares(hs.as_ptr(), hs.len() as i64, &mut out) };
    if rc == 0 && !out.is_null() {
        Ok(unsafe { Tensor::from_ptr(out) })
    } else {
        Err(format!("norm of {} tensors: {}", ts.len(), failed()))
    }
}

/// Calls a shim function that writes two new tensors, and takes ownership of them.
fn two_outputs(
    what: &str,
    call: impl FnOnce(*mut *mut C_tensor, *mut *mut C_tensor) -> c_int,
) -> Result<(Tensor, Tensor), String> {
    let (mut a, mut b): (*mut C_tensor, *mut C_tensor) =
        (std::ptr::null_mut(), std::ptr::null_mut());
    let rc = call(&mut a, &mut b);
    if rc == 0 && !a.is_null() && !b.is_null() {
        // SAFETY: on success both are new tensors the shim allocated for the caller.
        Ok(unsafe { (Tensor::from_ptr(a), Tensor::from_ptr(b)) })
    } else {
        Err(format!("{what}: {}", failed()))
    }
}

/// Layer norm's `(dx, dw)` over the last dimension by libtorch's backward kernel, from the
/// mean and rstd `native_layer_norm` returned (dx in `x`'s dtype, dw in `w`'s).
pub fn layer_norm_backward(
    dy: &Tensor,
    x: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    w: &Tensor,
) -> Result<(Tensor, Tensor), String> {
    two_outputs("layer norm backward", |dx, dw| {
        // SAFETY: borrowed live tensors in, new tensors out (see `two_outputs`).
        unsafe {
            osdp_layer_norm_backward(
                dy.as_ptr(),
                x.as_ptr(),
                mean.as_ptr(),
                rstd.as_ptr(),
                w.as_ptr(),
                dx,
                dw,
            )
        }
    })
}

/// RMS norm's `(dx, dw)` over the last dimension by libtorch's fused backward kernel (CUDA
/// only), from the rstd `_fused_rms_norm` returned.
pub fn rms_norm_backward(
    dy: &Tensor,
    x: &Tensor,
    rstd: &Tensor,
    w: &Tensor,
) -> Result<(Tensor, Tensor), String> {
    two_outputs("RMS norm backward", |dx, dw| {
        // SAFETY: borrowed live tensors in, new tensors out (see `two_outputs`).
        unsafe {
            osdp_rms_norm_backward(dy.as_ptr(), x.as_ptr(), rstd.as_ptr(), w.as_ptr(), dx, dw)
        }
    })
}

/// Says once on stderr that a fused kernel failed and the written-out path took over.
pub fn warn_fallback(flag: &std::sync::atomic::AtomicBool, err: &str) {
    if !flag.swap(true, std::sync::atomic::Ordering::Relaxed) {
        eprintln!("warning: {err}; using the unfused kernels instead");
    }
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind};

    use super::*;

    fn rand(shape: &[i64], seed: i64) -> Tensor {
        tch::manual_seed(seed);
        Tensor::randn(shape, (Kind::Float, Device::Cpu))
    }

    fn close(a: &Tensor, b: &Tensor, tol: f64) {
        let err = (a - b).abs().max().double_value(&[]);
        let scale = b.abs().max().double_value(&[]).max(1e-12);
        assert!(err <= tol * scale, "off by {err} of {scale}");
    }

    /// The fused kernel (libtorch's CPU one here, the same algorithm as the GPU's) is the
    /// trainer's written-out AdamW, clipping and weight decay included, over three steps.
    #[test]
    fn fused_adamw_is_the_written_out_update() {
        let o = crate::exec::OptimConfig::default();
        for (clip, decay) in [(1.0, 0.0), (0.25, 0.1)] {
            let (mut p, mut m, mut v) = (
                rand(&[700], 1),
                rand(&[700], 2).abs(),
                rand(&[700], 3).abs(),
            );
            let (p2, m2, v2) = (p.copy(), m.copy(), v.copy());
            let q2 = rand(&[33], 4);
            let (mut q, mut qm, mut qv) = (q2.copy(), q2.zeros_like(), q2.zeros_like());
            let (qm2, qv2) = (qm.copy(), qv.copy());
            let mut step = Tensor::zeros([], (Kind::Float, Device::Cpu));
            let h = AdamW {
                lr: 3e-3,
                beta1: o.beta1,
                beta2: o.beta2,
                weight_decay: decay,
                eps: o.eps,
            };
            for t in 1..=3 {
                let (g, gq) = (rand(&[700], 10 + t), rand(&[33], 20 + t));
                let bc = (1.0 - o.beta1.powf(t as f64), 1.0 - o.beta2.powf(t as f64));
                crate::exec::adamw_update(&mut p, &g, &mut m, &mut v, &o, h.lr, decay, clip, bc);
                crate::exec::adamw_update(&mut q, &gq, &mut qm, &mut qv, &o, h.lr, decay, clip, bc);
                let _ = step.fill_(t as f64);
                let scale = Tensor::from(1.0 / clip as f32);
                fused_adamw(
                    &[&p2, &q2],
                    &[&g, &gq],
                    &[&m2, &qm2],
                    &[&v2, &qv2],
                    &step,
                    h,
                    (clip != 1.0).then_some(&scale),
                )
                .unwrap();
            }
            for (a, b) in [
                (&p2, &p),
                (&m2, &m),
                (&v2, &v),
                (&q2, &q),
                (&qm2, &qm),
                (&qv2, &qv),
            ] {
                close(a, b, 1e-5);
            }
            // A mismatched call is an error, not an abort.
            let bf16 = p2.to_kind(Kind::BFloat16);
            assert!(fused_adamw(&[&bf16], &[&p2], &[&m2], &[&v2], &step, h, None).is_err());
        }
    }

    #[test]
    fn sum_of_squares_is_the_squared_norm_of_all() {
        let (a, b) = (rand(&[5, 7], 1), rand(&[300], 2));
        let want = a.square().sum(Kind::Double) + b.square().sum(Kind::Double);
        let got = sum_of_squares(&[&a, &b.to_kind(Kind::BFloat16).to_kind(Kind::Float)]).unwrap();
        close(&got.to_kind(Kind::Double), &want, 1e-2);
        let exact = sum_of_squares(&[&a, &b]).unwrap().to_kind(Kind::Double);
        close(&exact, &want, 1e-5);
    }

    /// libtorch's layer-norm backward kernel gives the written-out backward's gradients.
    #[test]
    fn layer_norm_backward_kernel_matches_the_written_out_one() {
        let (x, w, b, dy) = (
            rand(&[3, 5, 16], 1),
            rand(&[16], 2),
            rand(&[16], 3),
            rand(&[3, 5, 16], 4),
        );
        let (_, mean, rstd) = crate::ops::layer_norm_fwd(&x, &w, Some(&b), 1e-5);
        let (dx, dw) = layer_norm_backward(&dy, &x, &mean, &rstd, &w).unwrap();
        let (dx2, dw2, _) = crate::ops::layer_norm_bwd(&dy, &x, &mean, &rstd, &w, 1e-5);
        close(&dx, &dx2, 1e-5);
        close(&dw, &dw2, 1e-5);
    }

    /// The RMS norm's fused backward has no CPU kernel: an error to fall back on, not an abort.
    #[test]
    fn a_kernel_without_this_device_is_an_error() {
        let (x, w, dy) = (rand(&[2, 4, 8], 1), rand(&[8], 2), rand(&[2, 4, 8], 3));
        let rstd = Tensor::ones([2, 4, 1], (Kind::Float, Device::Cpu));
        let err = rms_norm_backward(&dy, &x, &rstd, &w).unwrap_err();
        assert!(err.starts_with("RMS norm backward: "), "{err}");
    }
}
