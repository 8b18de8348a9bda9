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

/// AdamW, gradient clipping and gradient bookkeeping: `per_tensor_s` for every parameter tensor
/// a rank updates (kernel launches, small-tensor overheads) plus `per_param_s` per element.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerCost {
    pub per_tensor_s: f64,
    pub per_param_s: f64,
}

/// A collective's measured times at one message size (bytes of the full tensor).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CollectivePoint {
    pub bytes: f64,
    pub all_gather_s: f64,
    pub reduce_scatter_s: f64,
    pub all_reduce_s: f64,
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
    pub optimizer: OptimizerCost,
    /// What a step costs besides its operators, collectives and optimizer: data, loss
    /// reduction, bookkeeping.
    pub step_overhead_s: f64,
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
            if !OpKind::ALL.iter().any(|k| kind_name(*k) == kind) {
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
        non_negative(
            "calibration.optimizer.per_tensor_s",
            self.optimizer.per_tensor_s,
        )?;
        non_negative(
            "calibration.optimizer.per_param_s",
            self.optimizer.per_param_s,
        )?;
        non_negative("calibration.step_overhead_s", self.step_overhead_s)?;
        if self.collectives.len() > MAX_POINTS {
            return Err(Problem::field(
                "calibration.collectives",
                format!("{} points; at most {MAX_POINTS}", self.collectives.len()),
            ));
        }
        Ok(())
    }

    /// Forward and backward seconds of an op doing `work`, when measured: the curve of its
    /// exact `key`, else of its kind, else of another variant of its kind.
    pub fn kernel_s(&self, key: &str, work: f64) -> Option<(f64, f64)> {
        let kind = key.split('/').next().unwrap_or(key);
        let prefix = format!("{kind}/");
        self.kernels
            .get(key)
            .or_else(|| self.kernels.get(kind))
            .or_else(|| {
                self.kernels
                    .iter()
                    .find(|(k, _)| k.starts_with(&prefix))
                    .map(|(_, v)| v)
            })
            .map(|pts| interpolate(pts, work))
    }

    /// One line for `plan` output: where the prices come from.
    pub fn summary(&self) -> String {
        format!("calibrated {} on {}", self.measured_at, self.device)
    }
}

/// `layer_norm` for [`OpKind::LayerNorm`]: the name model.json uses.
pub fn kind_name(kind: OpKind) -> String {
    serde_json::to_value(kind)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{kind:?}"))
}

/// Times at `work` from a sorted curve: log–log interpolation between neighbours (kernel
/// efficiency changes smoothly with size); outside the measured range, the nearest end's rate
/// (time proportional to work). An empty curve prices nothing.
pub fn interpolate(points: &[CurvePoint], work: f64) -> (f64, f64) {
    let (Some(first), Some(last)) = (points.first(), points.last()) else {
        return (0.0, 0.0);
    };
    if work <= 0.0 {
        return (0.0, 0.0);
    }
    let scale = |p: &CurvePoint| (p.fwd_s * work / p.work, p.bwd_s * work / p.work);
    if work <= first.work {
        return scale(first);
    }
    if work >= last.work {
        return scale(last);
    }
    // First point with work ≥ `work`; it has a predecessor because work > first.work.
    let hi = points.partition_point(|p| p.work < work);
    let (a, b) = (&points[hi - 1], &points[hi]);
    let t = (work.ln() - a.work.ln()) / (b.work.ln() - a.work.ln());
    let lerp = |x: f64, y: f64| {
        if x > 0.0 && y > 0.0 {
            (x.ln() + t * (y.ln() - x.ln())).exp()
        } else {
            x + t * (y - x)
        }
    };
    (lerp(a.fwd_s, b.fwd_s), lerp(a.bwd_s, b.bwd_s))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn pt(work: f64, fwd_s: f64, bwd_s: f64) -> CurvePoint {
        CurvePoint { work, fwd_s, bwd_s }
    }

    #[test]
    fn interpolation_is_log_log_between_points_and_constant_rate_outside() {
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
        // Below the smallest, the smallest point's rate.
        let (f, _) = interpolate(&c, 5e5);
        assert!((f - 5e-5).abs() < 1e-15);
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
            optimizer: OptimizerCost {
                per_tensor_s: 1e-5,
                per_param_s: 1e-9,
            },
            step_overhead_s: 1e-3,
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
        c.optimizer.per_param_s = -1.0;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("per_param_s"));
    }
}
