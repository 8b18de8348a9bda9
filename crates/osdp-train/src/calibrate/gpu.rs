//! `calibrate --device cuda`: one GPU measured with the trainer's own kernels, written into a
//! GPU layout as the efficiencies the cost model prices with. The bf16 linear forward and
//! backward over the shapes the planner prices (the models' own linears and a sweep of narrow
//! ones), the fused attention forward and backward (causal) per sequence length, element-wise
//! streaming through HBM, and the pinned host link. Each figure keeps its source: the GPU's
//! name, the date and the command.
//!
//! The measuring needs a GPU; turning measurements into a layout ([`apply`]) does not, and is
//! what the tests check.

use std::time::Instant;

use tch::{Device, Kind, Tensor};

use super::{median, HostMeasurement};
use crate::ops::{self, AttentionShape};
use crate::TrainError;
use osdp_core::cluster::calibration::fit_matmul_curve;
use osdp_core::cluster::{Figure, Layout};
use osdp_core::cost::{ATTENTION_BWD_FACTOR, ELEMENTWISE_BWD_FACTOR, LINEAR_BWD_FACTOR};
use osdp_core::model::{ModelSpec, OpKind};

/// One linear timed as the trainer runs it: `x [tokens, in] · Wᵀ` forward, then `dx` and `dW`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemmPoint {
    pub tokens: i64,
    pub in_features: i64,
    pub out_features: i64,
    pub fwd_s: f64,
    pub bwd_s: f64,
    /// Forward and backward as the trainer runs an unaligned weight, padded with zero rows
    /// ([`ops::gemm_rows`]); `None` where it runs it as it is.
    pub padded_s: Option<f64>,
}

impl GemmPoint {
    /// Forward FLOPs.
    pub fn flops(&self) -> f64 {
        2.0 * (self.tokens * self.in_features * self.out_features) as f64
    }

    /// Whether a side is not a multiple of 8, which the tensor-core kernels want.
    pub fn unaligned(&self) -> bool {
        [self.tokens, self.in_features, self.out_features]
            .iter()
            .any(|&d| !osdp_core::cost::gemm_aligned(d))
    }

    /// The GEMM's smallest side, the cost model's width.
    pub fn width(&self) -> f64 {
        self.tokens.min(self.in_features).min(self.out_features) as f64
    }

    /// Achieved fraction of `peak` FLOP/s over forward and backward, as the cost model counts
    /// them (the backward [`LINEAR_BWD_FACTOR`] times the forward's FLOPs).
    pub fn efficiency(&self, peak: f64) -> f64 {
        (1.0 + LINEAR_BWD_FACTOR) * self.flops() / (self.fwd_s + self.bwd_s) / peak
    }
}

/// The fused attention core timed at one shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionPoint {
    pub batch: i64,
    pub seq: i64,
    pub heads: i64,
    pub head_dim: i64,
    pub fwd_s: f64,
    pub bwd_s: f64,
}

impl AttentionPoint {
    /// FLOPs the causal kernel does forward (the masked half skipped), as the cost model
    /// counts them: half of `4 · heads · seq² · head_dim` per sample.
    pub fn causal_fwd_flops(&self) -> f64 {
        2.0 * (self.batch * self.heads * self.seq * self.seq * self.head_dim) as f64
    }
}

/// An element-wise kernel streamed through device memory.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamPoint {
    pub what: &'static str,
    /// Bytes read and written.
    pub bytes: f64,
    pub seconds: f64,
}

/// Everything `calibrate --device cuda` measured.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuMeasurement {
    pub gemm: Vec<GemmPoint>,
    pub attention: Vec<AttentionPoint>,
    pub stream: Vec<StreamPoint>,
    /// Layer and RMS norms, forward and backward: `bytes` is what the cost model prices them
    /// by (input and output, forward, and [`ELEMENTWISE_BWD_FACTOR`] times that backward).
    pub norm: Vec<StreamPoint>,
    /// The loss over a vocabulary, forward and backward, priced likewise.
    pub loss: Vec<StreamPoint>,
    pub host: Option<HostMeasurement>,
}

/// What to time.
#[derive(Debug, Clone)]
pub struct GpuBench {
    pub device_index: usize,
    /// Rows of every timed linear (micro-batch × sequence).
    pub tokens: i64,
    /// `(in, out)` features of the linears to time.
    pub linears: Vec<(i64, i64)>,
    /// `(seq, heads, head_dim)` of the attention cores to time.
    pub attention: Vec<(i64, i64, i64)>,
    /// Timed repetitions of each kernel (the median is kept).
    pub reps: usize,
}

impl GpuBench {
    /// Shapes the planner prices: with `models`, their own linears and attention cores; without,
    /// transformer widths from 1,024 to 4,096 features (GPT-2 medium to LLaMA-7B). Both add a
    /// sweep of narrow linears (64 to 1,024 outputs) for the efficiency's width curve. `quick`
    /// times fewer shapes, fewer times.
    pub fn for_models(device_index: usize, models: &[ModelSpec], quick: bool) -> GpuBench {
        let mut linears: Vec<(i64, i64)> = Vec::new();
        let mut attention: Vec<(i64, i64, i64)> = Vec::new();
        for m in models {
            for op in m.ops.iter().filter(|o| o.kind == OpKind::Linear) {
                if let Some(w) = op.params.first().filter(|p| p.shape.len() == 2) {
                    linears.push((w.shape[1], w.shape[0]));
                }
            }
            let c = &m.config;
            attention.push((c.seq_len as i64, c.heads as i64, c.head_dim as i64));
        }
        if models.is_empty() {
            let widths: &[i64] = if quick {
                &[1024, 4096]
            } else {
                &[1024, 1600, 2048, 4096]
            };
            for &h in widths {
                linears.extend([(h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)]);
            }
            attention = if quick {
                vec![(1024, 16, 64), (2048, 32, 128)]
            } else {
                vec![
                    (512, 16, 64),
                    (1024, 16, 64),
                    (2048, 32, 64),
                    (2048, 32, 128),
                    (4096, 32, 128),
                ]
            };
        }
        let narrow: &[i64] = if quick {
            &[64, 256]
        } else {
            &[64, 128, 256, 512, 1024]
        };
        linears.extend(narrow.iter().map(|&k| (4096, k)));
        // GPT-2's LM head, 50,257 wide: the unaligned GEMM rate.
        linears.push((1024, 50257));
        linears.sort_unstable();
        linears.dedup();
        attention.sort_unstable();
        attention.dedup();
        GpuBench {
            device_index,
            tokens: 8192,
            linears,
            attention,
            reps: if quick { 3 } else { 7 },
        }
    }
}

/// Seconds per call of `f`: calls are queued back to back between two waits for the device
/// (`sync`: returns once the queued work is done; nothing to wait for on the CPU), enough of
/// them to take ~2 ms so that the wait is not what is timed, `reps` times after a warm-up; the
/// median.
fn timed(sync: &dyn Fn(), reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    sync();
    let t0 = Instant::now();
    f();
    sync();
    let once = t0.elapsed().as_secs_f64().max(1e-6);
    let calls = (2e-3 / once).ceil().clamp(1.0, 200.0) as usize;
    let mut times: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let t0 = Instant::now();
            for _ in 0..calls {
                f();
            }
            sync();
            t0.elapsed().as_secs_f64() / calls as f64
        })
        .collect();
    median(&mut times)
}

/// Time what [`GpuBench`] lists on its GPU; `progress` is told each phase.
pub fn measure(
    bench: &GpuBench,
    progress: &mut dyn FnMut(f64, &str),
) -> Result<GpuMeasurement, TrainError> {
    let index = bench.device_index;
    if !tch::Cuda::is_available() || index as i64 >= tch::Cuda::device_count() {
        return Err(TrainError::Invalid(format!(
            "calibrate --device cuda: libtorch sees no CUDA device {index}"
        )));
    }
    let gpu = Device::Cuda(index);
    let sync = || tch::Cuda::synchronize(index as i64);
    let bf16 = (Kind::BFloat16, gpu);
    let total = (bench.linears.len() + bench.attention.len() + 3) as f64;
    let mut done = 0.0;
    let _guard = tch::no_grad_guard();

    let mut gemm = Vec::with_capacity(bench.linears.len());
    for &(inp, out) in &bench.linears {
        progress(
            done / total,
            &format!("bf16 linear {inp}→{out} × {} tokens", bench.tokens),
        );
        let x = Tensor::randn([bench.tokens, inp], bf16);
        let w = Tensor::randn([out, inp], bf16) * (1.0 / (inp as f64).sqrt());
        let dy = Tensor::randn([bench.tokens, out], bf16);
        // cuBLAS on the shape as given: what any code that does not pad gets.
        let fwd_s = timed(&sync, bench.reps, || {
            let _ = std::hint::black_box(ops::linear_fwd_plain(&x, &w));
        });
        let bwd_s = timed(&sync, bench.reps, || {
            let _ = std::hint::black_box(ops::linear_bwd_plain(&dy, &x, &w));
        });
        // And as the trainer runs it, where it pads the weight.
        let padded_s = ops::gemm_rows(&w).map(|rows| {
            timed(&sync, bench.reps, || {
                let _ = std::hint::black_box(ops::linear_fwd_padded(&x, &w, rows));
            }) + timed(&sync, bench.reps, || {
                let _ = std::hint::black_box(ops::linear_bwd_padded(&dy, &x, &w, rows));
            })
        });
        gemm.push(GemmPoint {
            tokens: bench.tokens,
            in_features: inp,
            out_features: out,
            fwd_s,
            bwd_s,
            padded_s,
        });
        done += 1.0;
    }

    let mut attention = Vec::with_capacity(bench.attention.len());
    for &(seq, heads, head_dim) in &bench.attention {
        progress(
            done / total,
            &format!("attention (causal) seq {seq}, {heads} heads × {head_dim}"),
        );
        let batch = (bench.tokens / seq).max(1);
        let shape = AttentionShape {
            heads,
            kv_heads: heads,
            head_dim,
            causal: true,
            rope_theta: None,
        };
        let width = heads * head_dim;
        let q = Tensor::randn([batch, seq, width], bf16);
        let k = Tensor::randn([batch, seq, width], bf16);
        let v = Tensor::randn([batch, seq, width], bf16);
        let dout = Tensor::randn([batch, seq, width], bf16);
        let fwd_s = timed(&sync, bench.reps, || {
            let _ = std::hint::black_box(ops::attention_fwd(&q, &k, &v, &shape, None));
        });
        let (out, saved) = ops::attention_fwd(&q, &k, &v, &shape, None);
        let bwd_s = timed(&sync, bench.reps, || {
            let _ = std::hint::black_box(ops::attention_bwd(
                &dout, &q, &k, &v, &out, &saved, &shape, None,
            ));
        });
        attention.push(AttentionPoint {
            batch,
            seq,
            heads,
            head_dim,
            fwd_s,
            bwd_s,
        });
        done += 1.0;
    }

    progress(done / total, "HBM: 1 GiB bf16 copy and GELU");
    let n: i64 = 1 << 29; // 1 GiB of bf16
    let src = Tensor::randn([n], bf16);
    let mut dst = Tensor::empty([n], bf16);
    let copy_s = timed(&sync, bench.reps, || {
        dst.copy_(&src);
    });
    done += 1.0;
    let gelu_s = timed(&sync, bench.reps, || {
        let _ = std::hint::black_box(src.gelu("tanh"));
    });
    done += 1.0;
    drop((src, dst));
    let bytes = 2.0 * 2.0 * n as f64;
    let stream = vec![
        StreamPoint {
            what: "copy",
            bytes,
            seconds: copy_s,
        },
        StreamPoint {
            what: "gelu",
            bytes,
            seconds: gelu_s,
        },
    ];

    progress(done / total, "norms and the loss, forward and backward");
    let (norm, loss) = time_norms_and_loss(gpu, &sync, bench.reps, bench.tokens);

    progress(done / total, "host: pinned link and CPU AdamW");
    let host = Some(super::measure_host(gpu, 1, &mut |_| {})?);
    progress(1.0, "done");
    Ok(GpuMeasurement {
        gemm,
        attention,
        stream,
        norm,
        loss,
        host,
    })
}

/// The trainer's layer and RMS norms (4,096 wide) and its loss (GPT-2's and LLaMA's
/// vocabularies), each forward then backward, over `tokens` rows in bf16; with the bytes the
/// cost model prices each by.
fn time_norms_and_loss(
    gpu: Device,
    sync: &dyn Fn(),
    reps: usize,
    tokens: i64,
) -> (Vec<StreamPoint>, Vec<StreamPoint>) {
    let bf16 = (Kind::BFloat16, gpu);
    let priced = |elems: i64, out_elems: i64| {
        (1.0 + ELEMENTWISE_BWD_FACTOR) * 2.0 * (elems + out_elems) as f64
    };
    let width = 4096;
    let x = Tensor::randn([tokens, width], bf16);
    let dy = Tensor::randn([tokens, width], bf16);
    let w = Tensor::ones([width], bf16);
    let b = Tensor::zeros([width], bf16);
    let layer = timed(sync, reps, || {
        let (y, mean, rstd) = ops::layer_norm_fwd(&x, &w, Some(&b), 1e-5);
        let _ = std::hint::black_box((y, ops::layer_norm_bwd(&dy, &x, &mean, &rstd, &w, 1e-5)));
    });
    let rms = timed(sync, reps, || {
        let (y, rstd) = ops::rms_norm_fwd(&x, &w, 1e-5);
        let _ = std::hint::black_box((y, ops::rms_norm_bwd(&dy, &x, &rstd, &w, 1e-5)));
    });
    let norm_bytes = priced(tokens * width, tokens * width);
    let norm = vec![
        StreamPoint {
            what: "layer norm 4096",
            bytes: norm_bytes,
            seconds: layer,
        },
        StreamPoint {
            what: "RMS norm 4096",
            bytes: norm_bytes,
            seconds: rms,
        },
    ];
    drop((x, dy));
    let mut loss = Vec::new();
    for (what, vocab) in [("loss, 50,257 words", 50257), ("loss, 32,000 words", 32000)] {
        let logits = Tensor::randn([1, tokens, vocab], bf16);
        let labels = Tensor::randint(vocab, [1, tokens], (Kind::Int64, gpu));
        let seconds = timed(sync, reps, || {
            let (l, logp) = ops::cross_entropy_fwd(&logits, &labels);
            let _ = std::hint::black_box((
                l,
                ops::cross_entropy_bwd(1.0, logp, &labels, Kind::BFloat16),
            ));
        });
        loss.push(StreamPoint {
            what,
            bytes: priced(tokens * vocab, 0),
            seconds,
        });
    }
    (norm, loss)
}

/// Where a measured figure comes from, in words.
pub struct Provenance<'a> {
    /// The GPU's name as the driver gives it (`NVIDIA H100 80GB HBM3`).
    pub gpu: &'a str,
    /// When, RFC 3339.
    pub measured_at: &'a str,
    pub command: &'a str,
}

impl Provenance<'_> {
    fn source(&self, what: &str) -> String {
        format!(
            "measured on {}, {}, `{}`: {what}",
            self.gpu, self.measured_at, self.command
        )
    }
}

/// `layout` with what was measured: the device's efficiencies (large-GEMM efficiency and its
/// width curve, attention forward and backward, element-wise streaming), its model name, and
/// the host link when timed. Peaks stay the datasheet's: efficiencies are fractions of them.
pub fn apply(
    layout: &mut Layout,
    m: &GpuMeasurement,
    from: &Provenance<'_>,
) -> Result<(), TrainError> {
    let peak = layout
        .device
        .dense_tflops
        .bf16
        .as_ref()
        .map(|f| f.value * 1e12)
        .ok_or_else(|| {
            TrainError::Invalid("the GPU layout names no bf16 peak to measure against".into())
        })?;
    let eff = &mut layout.device.efficiency;
    // A shape with a side not a multiple of 8 runs other kernels: it has a figure of its own
    // and stays out of the width curve's fit.
    let (unaligned, aligned): (Vec<GemmPoint>, Vec<GemmPoint>) =
        m.gemm.iter().copied().partition(GemmPoint::unaligned);
    if !unaligned.is_empty() {
        let flops: f64 = unaligned
            .iter()
            .map(|g| (1.0 + LINEAR_BWD_FACTOR) * g.flops())
            .sum();
        let secs: f64 = unaligned.iter().map(|g| g.fwd_s + g.bwd_s).sum();
        let shapes: Vec<String> = unaligned
            .iter()
            .map(|g| {
                let padded = g.padded_s.map_or(String::new(), |t| {
                    let tflops = (1.0 + LINEAR_BWD_FACTOR) * g.flops() / t / 1e12;
                    format!(" ({tflops:.0} TFLOP/s as the trainer runs it, padded)")
                });
                format!(
                    "{}×{}→{} at {:.0} TFLOP/s{padded}",
                    g.tokens,
                    g.in_features,
                    g.out_features,
                    g.efficiency(peak) * peak / 1e12
                )
            })
            .collect();
        eff.unaligned_matmul = Some(Figure {
            value: (flops / secs / peak).min(1.0),
            source: from.source(&format!(
                "bf16 linear forward + backward with a side not a multiple of 8: {}",
                shapes.join(", ")
            )),
        });
    }
    let widths: Vec<(f64, f64)> = aligned
        .iter()
        .map(|g| (g.width(), g.efficiency(peak)))
        .collect();
    if let Some((matmul, half_width)) = fit_matmul_curve(&widths) {
        let best = aligned
            .iter()
            .max_by(|a, b| a.efficiency(peak).total_cmp(&b.efficiency(peak)));
        let detail = best.map_or(String::new(), |g| {
            format!(
                "; the best {}×{}→{} at {:.0} TFLOP/s",
                g.tokens,
                g.in_features,
                g.out_features,
                g.efficiency(peak) * peak / 1e12
            )
        });
        eff.matmul = Some(Figure {
            value: matmul.min(1.0),
            source: from.source(&format!(
                "bf16 linear forward + backward (the trainer's kernels) over {} shapes, fitted \
                 e(k) = matmul·k/(k + half width) on the smallest side k{detail}",
                aligned.len()
            )),
        });
        eff.matmul_half_width = Some(Figure {
            value: half_width,
            source: from.source("the same fit's half width, in features"),
        });
    }
    if !m.attention.is_empty() {
        let flops: f64 = m
            .attention
            .iter()
            .map(AttentionPoint::causal_fwd_flops)
            .sum();
        let fwd: f64 = m.attention.iter().map(|a| a.fwd_s).sum();
        let bwd: f64 = m.attention.iter().map(|a| a.bwd_s).sum();
        let per_seq: Vec<String> = m
            .attention
            .iter()
            .map(|a| {
                format!(
                    "seq {} d {}: {:.0}/{:.0} TFLOP/s",
                    a.seq,
                    a.head_dim,
                    a.causal_fwd_flops() / a.fwd_s / 1e12,
                    ATTENTION_BWD_FACTOR * a.causal_fwd_flops() / a.bwd_s / 1e12
                )
            })
            .collect();
        let what = format!(
            "the trainer's fused causal attention, all shapes' FLOPs over their time (forward/backward: {})",
            per_seq.join(", ")
        );
        eff.attention_forward = Some(Figure {
            value: (flops / fwd / peak).min(1.0),
            source: from.source(&what),
        });
        eff.attention_backward = Some(Figure {
            value: (ATTENTION_BWD_FACTOR * flops / bwd / peak).min(1.0),
            source: from.source(&what),
        });
    }
    let datasheet = layout.device.memory_bandwidth_gb_per_s.value * 1e9;
    if let Some(gelu) = m.stream.iter().find(|s| s.what == "gelu") {
        let rates: Vec<String> = m
            .stream
            .iter()
            .map(|s| format!("{} {:.0} GB/s", s.what, s.bytes / s.seconds / 1e9))
            .collect();
        layout.device.efficiency.memory = Some(Figure {
            value: (gelu.bytes / gelu.seconds / datasheet).min(1.0),
            source: from.source(&format!(
                "an element-wise kernel (GELU) over 1 GiB of bf16, bytes read and written over \
                 the datasheet's {:.0} GB/s ({})",
                datasheet / 1e9,
                rates.join(", ")
            )),
        });
    }
    let bandwidth = layout.device.memory_bandwidth_gb_per_s.value * 1e9;
    for (points, what, slot) in [
        (
            &m.norm,
            "layer and RMS norms",
            &mut layout.device.efficiency.norm,
        ),
        (
            &m.loss,
            "the loss (fp32 log-softmax and its gradient)",
            &mut layout.device.efficiency.loss,
        ),
    ] {
        if points.is_empty() {
            continue;
        }
        let bytes: f64 = points.iter().map(|p| p.bytes).sum();
        let secs: f64 = points.iter().map(|p| p.seconds).sum();
        let each: Vec<String> = points
            .iter()
            .map(|p| format!("{} {:.0} GB/s", p.what, p.bytes / p.seconds / 1e9))
            .collect();
        *slot = Some(Figure {
            value: (bytes / secs / bandwidth).min(1.0),
            source: from.source(&format!(
                "{what}, forward and backward (the trainer's kernels), the bytes the cost model \
                 prices them by over the datasheet's {:.0} GB/s ({})",
                bandwidth / 1e9,
                each.join(", ")
            )),
        });
    }
    if let Some(host) = &m.host {
        layout.host = Some(super::host_spec(layout, host, from.measured_at));
    }
    layout.device.efficiency.measured_at = Some(from.measured_at.to_string());
    layout.device.model = from.gpu.to_string();
    osdp_core::cluster::validate_layout(layout)
        .map_err(|p| TrainError::Invalid(format!("the measured layout is not valid: {p}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h100() -> Layout {
        osdp_core::input::parse_strict(
            std::path::Path::new("h100-1x.json"),
            include_str!("../../../../layouts/h100-1x.json"),
            osdp_core::cluster::LAYOUT_FORMAT_VERSION,
        )
        .unwrap()
    }

    /// A GPU whose linears run at `0.75 · k / (k + 200)` of the peak (a 50,257-wide one at
    /// 12 %), attention forward at 40 % and backward at 30 %, GELU at 2.5 TB/s.
    fn synthetic(peak: f64) -> GpuMeasurement {
        let gemm = [
            (4096, 64),
            (4096, 256),
            (1024, 4096),
            (4096, 16384),
            (1024, 50257),
        ]
        .iter()
        .map(|&(inp, out)| {
            let mut g = GemmPoint {
                tokens: 8192,
                in_features: inp,
                out_features: out,
                fwd_s: 1.0,
                bwd_s: 0.0,
                padded_s: None,
            };
            let k = g.width();
            let e = if g.unaligned() {
                0.12
            } else {
                0.75 * k / (k + 200.0)
            };
            let t = 3.0 * g.flops() / (peak * e);
            g.fwd_s = t / 3.0;
            g.bwd_s = 2.0 * t / 3.0;
            g
        })
        .collect();
        let mut a = AttentionPoint {
            batch: 4,
            seq: 2048,
            heads: 32,
            head_dim: 128,
            fwd_s: 0.0,
            bwd_s: 0.0,
        };
        a.fwd_s = a.causal_fwd_flops() / (0.4 * peak);
        a.bwd_s = ATTENTION_BWD_FACTOR * a.causal_fwd_flops() / (0.3 * peak);
        GpuMeasurement {
            gemm,
            attention: vec![a],
            stream: vec![StreamPoint {
                what: "gelu",
                bytes: 2.5e12,
                seconds: 1.0,
            }],
            // Norms at 1 TB/s, the loss at 0.5 TB/s on their priced bytes.
            norm: vec![StreamPoint {
                what: "layer norm 4096",
                bytes: 1e12,
                seconds: 1.0,
            }],
            loss: vec![
                StreamPoint {
                    what: "loss, 50,257 words",
                    bytes: 0.5e12,
                    seconds: 1.0,
                },
                StreamPoint {
                    what: "loss, 32,000 words",
                    bytes: 1.0e12,
                    seconds: 2.0,
                },
            ],
            host: None,
        }
    }

    #[test]
    fn measured_efficiencies_land_in_the_layout_with_their_source() {
        let mut layout = h100();
        let peak = 989e12;
        let from = Provenance {
            gpu: "NVIDIA H100 80GB HBM3",
            measured_at: "2026-11-26T12:00:00Z",
            command: "osdp-tui calibrate --device cuda",
        };
        apply(&mut layout, &synthetic(peak), &from).unwrap();
        let e = &layout.device.efficiency;
        let get = |f: &Option<Figure>| f.as_ref().unwrap().value;
        assert!((get(&e.matmul) - 0.75).abs() < 1e-9, "{:?}", e.matmul);
        assert!((get(&e.matmul_half_width) - 200.0).abs() < 1e-6);
        assert!((get(&e.attention_forward) - 0.4).abs() < 1e-9);
        assert!((get(&e.attention_backward) - 0.3).abs() < 1e-9);
        assert!((get(&e.memory) - 2500.0 / 3350.0).abs() < 1e-9);
        // Norms and the loss against the datasheet's 3,350 GB/s, each with its shapes' rates.
        assert!((get(&e.norm) - 1000.0 / 3350.0).abs() < 1e-9);
        assert!((get(&e.loss) - 500.0 / 3350.0).abs() < 1e-9);
        let loss = &e.loss.as_ref().unwrap().source;
        assert!(loss.contains("loss, 32,000 words 500 GB/s"), "{loss}");
        let eff = osdp_core::cost::Efficiencies::of(&layout);
        assert_eq!((eff.norm(), eff.loss()), (get(&e.norm), get(&e.loss)));
        // The unaligned head has its own figure and leaves the curve's fit alone.
        assert!((get(&e.unaligned_matmul) - 0.12).abs() < 1e-9);
        let unaligned = &e.unaligned_matmul.as_ref().unwrap().source;
        assert!(unaligned.contains("8192×1024→50257"), "{unaligned}");
        assert_eq!(
            osdp_core::cost::Efficiencies::of(&layout).unaligned_matmul,
            get(&e.unaligned_matmul)
        );
        assert_eq!(layout.device.model, "NVIDIA H100 80GB HBM3");
        let src = &e.matmul.as_ref().unwrap().source;
        assert!(
            src.starts_with("measured on NVIDIA H100 80GB HBM3, 2026-11-26"),
            "{src}"
        );
        // The planner now prices with them.
        let eff = osdp_core::cost::Efficiencies::of(&layout);
        assert_eq!(eff.source, osdp_core::cost::Efficiencies::MEASURED);
        assert_eq!(layout.measured_at(), Some("2026-11-26T12:00:00Z"));
        assert!((eff.attention_forward - 0.4).abs() < 1e-9);
    }

    /// The norms' and the loss's timing runs the trainer's kernels end to end (here on the
    /// CPU, a few rows): every point timed, with the bytes the cost model prices.
    #[test]
    fn norms_and_the_loss_are_timed_with_their_priced_bytes() {
        let (norm, loss) = time_norms_and_loss(Device::Cpu, &|| {}, 1, 16);
        assert_eq!(norm.len(), 2);
        assert_eq!(loss.len(), 2);
        for p in norm.iter().chain(&loss) {
            assert!(p.seconds > 0.0 && p.seconds.is_finite(), "{p:?}");
        }
        assert_eq!(norm[0].bytes, 3.0 * 2.0 * 2.0 * 16.0 * 4096.0);
        assert_eq!(loss[0].bytes, 3.0 * 2.0 * 16.0 * 50257.0);
    }

    #[test]
    fn default_shapes_cover_narrow_and_wide_linears_and_several_sequence_lengths() {
        let b = GpuBench::for_models(0, &[], false);
        let widths: Vec<i64> = b.linears.iter().map(|&(i, o)| i.min(o)).collect();
        assert!(widths.contains(&64) && widths.contains(&4096));
        // One unaligned shape, GPT-2's head, quick or not.
        for quick in [false, true] {
            let b = GpuBench::for_models(0, &[], quick);
            assert!(
                b.linears
                    .iter()
                    .any(|&(_, o)| !osdp_core::cost::gemm_aligned(o)),
                "{:?}",
                b.linears
            );
        }
        let seqs: std::collections::BTreeSet<i64> = b.attention.iter().map(|a| a.0).collect();
        assert!(seqs.len() >= 3);
        assert!(GpuBench::for_models(0, &[], true).linears.len() < b.linears.len());
    }
}
