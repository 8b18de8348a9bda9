//! What `osdp-tui calibrate` measured on a machine, stored in a layout file's `calibration`
//! section: per operator kind a curve of kernel times against work (an efficiency curve, not
//! one number), the optimizer's cost per tensor and per parameter, and the fixed cost of a step.
//! The cost model prices with these where present and falls back on datasheet rates otherwise.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::input::Problem;
use crate::model::OpKind;

/// Most points one curve may hold (a hostile file cannot make pricing slow).
pub const MAX_POINTS: usize = 256;

/// One measurement: at `work` units of work the trainer's kernels took `fwd_s` forward and
/// `bwd_s` backward. Work is FLOPs for linears and attention, bytes moved (inputs + output at
/// the trainer's precision) for the memory-bound kinds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CurvePoint {
    pub work: f64,
    pub fwd_s: f64,
    pub bwd_s: f64,
}

/// What updating one parameter tensor of `params` elements costs a rank: its gradient buffer,
/// its share of the global norm and the AdamW update. Small tensors pay fixed costs, large ones
/// leave the caches: a curve, not a rate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerPoint {
    pub params: f64,
    pub seconds: f64,
}

/// Collectives as the trainer met them inside training steps, per message size (bytes of the
/// full tensor): the median all-gather and reduce-scatter, waiting for the other ranks included.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CollectivePoint {
    pub bytes: f64,
    pub seconds: f64,
    /// How many calls the median is of.
    pub calls: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Calibration {
    /// When, in UTC (RFC 3339).
    pub measured_at: String,
    /// What was measured, in words (CPU model or GPU name, threads per rank).
    pub device: String,
    /// The command line that measured it.
    pub command: String,
    /// Ranks that ran concurrently while kernels were timed (they share caches and memory
    /// bandwidth, as in training).
    pub ranks: u32,
    /// Kernel time curves, points sorted by work, keyed by operator kind (`linear`,
    /// `layer_norm`, …) or kind and variant (`activation/gelu_tanh`, `activation/silu_gated`):
    /// see [`crate::cost::kernel_key`].
    pub kernels: BTreeMap<String, Vec<CurvePoint>>,
    /// Optimizer cost per tensor against its elements, sorted by elements.
    pub optimizer: Vec<OptimizerPoint>,
    /// What a step costs besides its operators, collectives and optimizer: data, loss
    /// reduction, bookkeeping.
    pub step_overhead_s: f64,
    /// Share of CPU time the hypervisor stole while measuring (cloud VMs); above a few percent
    /// the figures are suspect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_steal_fraction: Option<f64>,
    /// Collective times per message size, from which the layout's link figures were fitted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub collectives: Vec<CollectivePoint>,
}

fn positive(field: &str, v: f64) -> Result<(), Problem> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(Problem::field(
            field,
            format!("must be a positive number, got {v}"),
        ))
    }
}

fn non_negative(field: &str, v: f64) -> Result<(), Problem> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(Problem::field(
            field,
            format!("must be zero or more, got {v}"),
        ))
    }
}

impl Calibration {
    pub fn validate(&self) -> Result<(), Problem> {
        if self.measured_at.trim().is_empty() {
            return Err(Problem::field(
                "calibration.measured_at",
                "must say when the figures were measured",
            ));
        }
        if self.ranks == 0 {
            return Err(Problem::field("calibration.ranks", "must be at least 1"));
        }
        for (key, points) in &self.kernels {
            let field = format!("calibration.kernels.{key}");
            let kind = key.split('/').next().unwrap_or_default();
            if !OpKind::ALL.iter().any(|k| k.as_str() == kind) {
                return Err(Problem::field(
                    &field,
                    format!("{kind:?} is not an operator kind"),
                ));
            }
            if points.is_empty() {
                return Err(Problem::field(&field, "needs at least one point"));
            }
            if points.len() > MAX_POINTS {
                return Err(Problem::field(
                    &field,
                    format!("{} points; at most {MAX_POINTS}", points.len()),
                ));
            }
            for (i, p) in points.iter().enumerate() {
                positive(&format!("{field}[{i}].work"), p.work)?;
                non_negative(&format!("{field}[{i}].fwd_s"), p.fwd_s)?;
                non_negative(&format!("{field}[{i}].bwd_s"), p.bwd_s)?;
                if i > 0 && p.work <= points[i - 1].work {
                    return Err(Problem::field(
                        &field,
                        "points must be sorted by strictly increasing work",
                    ));
                }
            }
        }
        if self.optimizer.len() > MAX_POINTS {
            return Err(Problem::field(
                "calibration.optimizer",
                format!("{} points; at most {MAX_POINTS}", self.optimizer.len()),
            ));
        }
        for (i, p) in self.optimizer.iter().enumerate() {
            positive(&format!("calibration.optimizer[{i}].params"), p.params)?;
            non_negative(&format!("calibration.optimizer[{i}].seconds"), p.seconds)?;
            if i > 0 && p.params <= self.optimizer[i - 1].params {
                return Err(Problem::field(
                    "calibration.optimizer",
                    "points must be sorted by strictly increasing params",
                ));
            }
        }
        non_negative("calibration.step_overhead_s", self.step_overhead_s)?;
        self.check_collectives_and_steal()
    }

    /// The collectives measured (a message of some bytes, the time it took) and the share of
    /// CPU time stolen (from none to all of it).
    fn check_collectives_and_steal(&self) -> Result<(), Problem> {
        if let Some(f) = self.cpu_steal_fraction {
            if !(f.is_finite() && (0.0..=1.0).contains(&f)) {
                return Err(Problem::field(
                    "calibration.cpu_steal_fraction",
                    format!("must be a share from 0 to 1, got {f}"),
                ));
            }
        }
        if self.collectives.len() > MAX_POINTS {
            return Err(Problem::field(
                "calibration.collectives",
                format!("{} points; at most {MAX_POINTS}", self.collectives.len()),
            ));
        }
        for (i, p) in self.collectives.iter().enumerate() {
            positive(&format!("calibration.collectives[{i}].bytes"), p.bytes)?;
            non_negative(&format!("calibration.collectives[{i}].seconds"), p.seconds)?;
        }
        Ok(())
    }

    /// Forward and backward seconds of an op doing `work`, when measured: the curve of its
    /// exact `key`, else of its kind, else of another variant of its kind.
    pub fn kernel_s(&self, key: &str, work: f64) -> Option<(f64, f64)> {
        let kind = kind_of(key);
        self.kernels
            .get(key)
            .or_else(|| self.kernels.get(kind))
            .or_else(|| {
                self.kernels
                    .iter()
                    .find(|(k, _)| kind_of(k) == kind)
                    .map(|(_, v)| v)
            })
            .map(|pts| interpolate(pts, work))
    }

    /// Seconds to update one tensor of `params` elements (0 for none, or without a curve).
    pub fn optimizer_s(&self, params: u64) -> f64 {
        if params == 0 {
            return 0.0;
        }
        interpolate_by(&self.optimizer, params as f64, |p| (p.params, p.seconds))
    }

    /// One line for `plan` output: where the prices come from.
    pub fn summary(&self) -> String {
        format!("calibrated {} on {}", self.measured_at, self.device)
    }
}

/// The operator kind of a curve key: `activation` of `activation/gelu_tanh`.
fn kind_of(key: &str) -> &str {
    key.split('/').next().unwrap_or(key)
}

/// Times at `work` from a sorted curve: log–log interpolation between neighbours (kernel
/// efficiency changes smoothly with size); above the measured range the largest point's rate
/// (time proportional to work), below it the smallest point's time (small kernels cost their
/// fixed overheads). An empty curve prices nothing.
pub fn interpolate(points: &[CurvePoint], work: f64) -> (f64, f64) {
    (
        interpolate_by(points, work, |p| (p.work, p.fwd_s)),
        interpolate_by(points, work, |p| (p.work, p.bwd_s)),
    )
}

/// `y` at `x` on points sorted by `x`, `xy` reading each point's `(x, y)`, as [`interpolate`]
/// describes. The cost model calls this per operator and choice: it allocates nothing.
pub fn interpolate_by<T>(points: &[T], x: f64, xy: impl Fn(&T) -> (f64, f64)) -> f64 {
    let (Some(first), Some(last)) = (points.first().map(&xy), points.last().map(&xy)) else {
        return 0.0;
    };
    if x <= 0.0 {
        return 0.0;
    }
    if x <= first.0 {
        return first.1;
    }
    if x >= last.0 {
        return last.1 * x / last.0;
    }
    // First point with x ≥ `x`; it has a predecessor because x > first.0.
    let hi = points.partition_point(|p| xy(p).0 < x);
    let (a, b) = (xy(&points[hi - 1]), xy(&points[hi]));
    let t = (x.ln() - a.0.ln()) / (b.0.ln() - a.0.ln());
    if a.1 > 0.0 && b.1 > 0.0 {
        (a.1.ln() + t * (b.1.ln() - a.1.ln())).exp()
    } else {
        a.1 + t * (b.1 - a.1)
    }
}

/// Fit the α–β ring model to measured all-gathers: `t = (n−1)·α + (n−1)/n · S / β`. Returns
/// (α seconds per step, β bytes per second): β from the slope between the smallest and the
/// largest message, α from what the smallest message takes beyond its bytes (a least-squares
/// fit would let the large messages drown the latency). `None` without two distinct sizes or
/// when the slope is not physical.
pub fn fit_ring(ranks: u32, points: &[(f64, f64)]) -> Option<(f64, f64)> {
    if ranks < 2 {
        return None;
    }
    let small = points.iter().min_by(|a, b| a.0.total_cmp(&b.0))?;
    let large = points.iter().max_by(|a, b| a.0.total_cmp(&b.0))?;
    if large.0 <= small.0 {
        return None;
    }
    let slope = (large.1 - small.1) / (large.0 - small.0);
    if !(slope.is_finite() && slope > 0.0) {
        return None;
    }
    let r = f64::from(ranks);
    let beta = (r - 1.0) / r / slope;
    let alpha = ((small.1 - slope * small.0) / (r - 1.0)).max(0.0);
    Some((alpha, beta))
}

/// Fit the cost model's GEMM efficiency curve `e(k) = matmul · k / (k + half_width)` to measured
/// efficiencies at widths `k` (a GEMM's smallest side): a least-squares line through
/// `1/e = 1/matmul + (half_width/matmul) · 1/k`. Returns `(matmul, half_width)`, the half width
/// 0 when narrow GEMMs are no slower; `None` without a finite positive point. Where noise
/// bends the line past the vertical axis (no positive asymptote), `matmul` is the best point's
/// efficiency and the half width the median of what each point implies at that asymptote.
pub fn fit_matmul_curve(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let pts: Vec<(f64, f64)> = points
        .iter()
        .filter(|(k, e)| k.is_finite() && *k > 0.0 && e.is_finite() && *e > 0.0)
        .map(|&(k, e)| (1.0 / k, 1.0 / e))
        .collect();
    if pts.is_empty() {
        return None;
    }
    let n = pts.len() as f64;
    let mx = pts.iter().map(|p| p.0).sum::<f64>() / n;
    let my = pts.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let slope = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    if slope <= 0.0 {
        // No width effect: one efficiency, the points' harmonic mean (time-weighted).
        return Some((1.0 / my, 0.0));
    }
    let intercept = my - slope * mx;
    if intercept > 0.0 {
        return Some((1.0 / intercept, slope / intercept));
    }
    let best = pts.iter().map(|p| 1.0 / p.1).fold(0.0, f64::max);
    let mut implied: Vec<f64> = pts
        .iter()
        .map(|&(inv_k, inv_e)| ((best * inv_e - 1.0) / inv_k).max(0.0))
        .collect();
    implied.sort_by(f64::total_cmp);
    Some((best, implied[implied.len() / 2]))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_matmul_curve_fit_recovers_its_own_parameters() {
        let curve = |k: f64| 0.8 * k / (k + 300.0);
        let pts: Vec<(f64, f64)> = [64.0, 128.0, 512.0, 2048.0, 8192.0]
            .iter()
            .map(|&k| (k, curve(k)))
            .collect();
        let (m, hw) = fit_matmul_curve(&pts).unwrap();
        assert!((m - 0.8).abs() < 1e-9, "{m}");
        assert!((hw - 300.0).abs() < 1e-6, "{hw}");
        // Narrow GEMMs as fast as wide ones: no half width, the common efficiency.
        let (m, hw) = fit_matmul_curve(&[(64.0, 0.5), (4096.0, 0.5)]).unwrap();
        assert!((m - 0.5).abs() < 1e-12 && hw == 0.0);
        assert_eq!(fit_matmul_curve(&[(0.0, 0.5), (64.0, f64::NAN)]), None);
        // A narrow outlier that no positive asymptote explains: the best point's efficiency,
        // a half width that the points imply, never nothing.
        let noisy = [(64.0, 0.02), (128.0, 0.5), (4096.0, 0.6), (8192.0, 0.62)];
        let (m, hw) = fit_matmul_curve(&noisy).unwrap();
        assert_eq!(m, 0.62);
        assert!(hw > 0.0 && hw.is_finite(), "{hw}");
    }

    use super::*;

    fn pt(work: f64, fwd_s: f64, bwd_s: f64) -> CurvePoint {
        CurvePoint { work, fwd_s, bwd_s }
    }

    #[test]
    fn interpolation_is_log_log_between_points_and_flat_or_constant_rate_outside() {
        let c = [pt(1e6, 1e-4, 2e-4), pt(1e8, 1e-3, 3e-3)];
        // Ends are exact.
        assert_eq!(interpolate(&c, 1e6), (1e-4, 2e-4));
        let (f, b) = interpolate(&c, 1e8);
        assert!((f - 1e-3).abs() < 1e-15 && (b - 3e-3).abs() < 1e-15);
        // Half-way in log work is the geometric mean of the times.
        let (f, b) = interpolate(&c, 1e7);
        assert!((f - (1e-4f64 * 1e-3).sqrt()).abs() < 1e-12, "{f}");
        assert!((b - (2e-4f64 * 3e-3).sqrt()).abs() < 1e-12, "{b}");
        // Beyond the largest point, time grows with work at the largest point's rate.
        let (f, _) = interpolate(&c, 4e8);
        assert!((f - 4e-3).abs() < 1e-12);
        // Below the smallest, the smallest point's time: fixed costs do not shrink.
        let (f, _) = interpolate(&c, 5e5);
        assert_eq!(f, 1e-4);
        assert_eq!(interpolate(&[], 1.0), (0.0, 0.0));
    }

    #[test]
    fn ring_fit_recovers_alpha_and_beta() {
        // 4 ranks, α = 20 µs, β = 5 GB/s.
        let (alpha, beta) = (20e-6, 5e9);
        let pts: Vec<(f64, f64)> = [1e3, 1e5, 1e7, 1e8]
            .iter()
            .map(|&s| (s, 3.0 * alpha + 0.75 * s / beta))
            .collect();
        let (a, b) = fit_ring(4, &pts).unwrap();
        assert!((a - alpha).abs() < 1e-12, "{a}");
        assert!((b - beta).abs() / beta < 1e-9, "{b}");
        assert_eq!(fit_ring(1, &pts), None);
        assert_eq!(fit_ring(4, &pts[..1]), None);
    }

    fn calibration() -> Calibration {
        Calibration {
            measured_at: "2026-11-22T09:00:00Z".into(),
            device: "test cpu".into(),
            command: "osdp-tui calibrate".into(),
            ranks: 2,
            kernels: BTreeMap::from([
                ("linear".to_string(), vec![pt(1e6, 1e-4, 2e-4)]),
                (
                    "activation/silu_gated".to_string(),
                    vec![pt(1e6, 1e-3, 2e-3)],
                ),
            ]),
            optimizer: vec![
                OptimizerPoint {
                    params: 1e3,
                    seconds: 1e-5,
                },
                OptimizerPoint {
                    params: 1e6,
                    seconds: 1e-3,
                },
            ],
            step_overhead_s: 1e-3,
            cpu_steal_fraction: None,
            collectives: vec![],
        }
    }

    #[test]
    fn a_variant_without_its_own_curve_uses_its_kinds() {
        let c = calibration();
        assert_eq!(c.kernel_s("linear", 1e6), Some((1e-4, 2e-4)));
        assert_eq!(c.kernel_s("activation/silu_gated", 1e6), Some((1e-3, 2e-3)));
        // Another activation borrows the measured one rather than falling back to datasheets.
        assert_eq!(c.kernel_s("activation/relu", 1e6), Some((1e-3, 2e-3)));
        assert_eq!(c.kernel_s("attention", 1e6), None);
    }

    #[test]
    fn optimizer_cost_follows_its_curve_by_tensor_size() {
        let c = calibration();
        assert_eq!(c.optimizer_s(0), 0.0);
        // A bias of 100 elements costs what the smallest measured tensor did.
        assert_eq!(c.optimizer_s(100), 1e-5);
        // Half-way in log size: the geometric mean.
        assert!((c.optimizer_s(31_623) - 1e-4).abs() < 1e-8);
        // Beyond the largest: its rate.
        assert!((c.optimizer_s(4_000_000) - 4e-3).abs() < 1e-12);
    }

    #[test]
    fn validation_names_the_bad_field() {
        assert!(calibration().validate().is_ok());
        let mut c = calibration();
        c.kernels.insert(
            "layer_norm".into(),
            vec![pt(2.0, 1.0, 1.0), pt(1.0, 1.0, 1.0)],
        );
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("layer_norm") && e.contains("sorted"), "{e}");
        let mut c = calibration();
        c.kernels
            .insert("convolution".into(), vec![pt(1.0, 1.0, 1.0)]);
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("not an operator kind"), "{e}");
        let mut c = calibration();
        c.kernels.insert("add".into(), vec![pt(1.0, f64::NAN, 1.0)]);
        assert!(c.validate().unwrap_err().to_string().contains("fwd_s"));
        let mut c = calibration();
        c.optimizer[1].seconds = -1.0;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("optimizer[1].seconds"));
        let mut c = calibration();
        c.optimizer.swap(0, 1);
        assert!(c.validate().unwrap_err().to_string().contains("sorted"));
    }

    #[test]
    fn validation_refuses_negative_or_unreal_collectives_and_steal() {
        let point = |bytes: f64, seconds: f64| CollectivePoint {
            bytes,
            seconds,
            calls: 3,
        };
        let mut c = calibration();
        c.cpu_steal_fraction = Some(0.02);
        c.collectives = vec![point(1e3, 0.0), point(1e6, 1e-3)];
        assert!(c.validate().is_ok());
        for (steal, shown) in [(-0.1, "-0.1"), (1.5, "1.5"), (f64::NAN, "NaN")] {
            let mut c = calibration();
            c.cpu_steal_fraction = Some(steal);
            let e = c.validate().unwrap_err().to_string();
            assert!(
                e.contains("calibration.cpu_steal_fraction") && e.contains(shown),
                "{e}"
            );
        }
        for (p, field) in [
            (point(-1e6, 1e-3), "collectives[1].bytes"),
            (point(0.0, 1e-3), "collectives[1].bytes"),
            (point(f64::INFINITY, 1e-3), "collectives[1].bytes"),
            (point(1e6, -1e-3), "collectives[1].seconds"),
            (point(1e6, f64::NAN), "collectives[1].seconds"),
        ] {
            let mut c = calibration();
            c.collectives = vec![point(1e3, 1e-4), p];
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(&format!("calibration.{field}")), "{e}");
        }
    }
}
