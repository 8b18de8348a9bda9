//! What a way of running an operator is: its sharding [`Strategy`], its [`Offload`], the
//! [`Choice`] of both with OSDP's operator splitting, the [`Unit`]s and [`Holding`]s a choice
//! holds an op's parameters as, and the choices the planner may make for an op.

use serde::{Deserialize, Serialize};

use crate::model::OpKind;

use super::{Machine, OpBase, Precision, HOST_STATE_BYTES_PER_PARAM};

/// How one operator's parameters are held across the data-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// The op owns no parameters: nothing to shard.
    None,
    /// Replicated (DDP): gradients all-reduced.
    Dp,
    /// Optimizer states sharded.
    Zero1,
    /// Optimizer states and gradients sharded.
    Zero2,
    /// Everything sharded (FSDP FULL_SHARD); parameters gathered for use.
    Zero3,
    /// Hybrid sharding (FSDP HYBRID_SHARD, ZeRO++ hpZ): everything sharded over the ranks of
    /// a node and replicated across nodes; parameters gathered inside the node, gradient
    /// shards all-reduced across the nodes once a step. Multi-node layouts only.
    Hsdp,
}

/// Everything about a strategy that is data rather than arithmetic, in one place: the name
/// plan files, `--pin` and the dashboard use, how it holds an op's parameters, what it needs
/// of the layout, whether its compute copy may leave the device, and how the dashboard shows
/// it. The cost model, the planner's choice list, the plan file reader, the trainer (through
/// [`Holding`]), the pin cycle, the theme and the legend read it from [`Strategy::ALL`];
/// what a strategy costs is its arm in `cost::price`, and how it runs is its [`Holding`]'s in
/// the trainer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StrategyInfo {
    pub strategy: Strategy,
    /// Its name in plan files, on the command line and on screen.
    pub name: &'static str,
    /// Other names [`Strategy::parse`] takes.
    pub aliases: &'static [&'static str],
    /// How a whole (unsplit) parameter tensor is held under it.
    pub holding: Holding,
    /// Whether it is for ops that own parameters (all but `none`).
    pub owns_params: bool,
    /// What it needs of the layout.
    pub needs: Needs,
    /// Whether the compute copy may be offloaded too (`+offload-param`): only where each rank
    /// updates exactly what it holds; the optimizer state may leave under any strategy that
    /// owns parameters.
    pub offloads_params: bool,
    /// Its colour on the dashboard.
    pub colour: Colour,
    /// The names of its baseline (this strategy everywhere, as its users run it) without and
    /// with full activation checkpointing, if it has one.
    pub baseline: Option<[&'static str; 2]>,
}

const _: () = assert!(
    Strategy::rows_in_order(),
    "Strategy::ALL is in the enum's order"
);

/// What a strategy needs of the layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Needs {
    Nothing,
    /// Ranks on several nodes (it shards inside a node and replicates across).
    SeveralNodes,
}

/// One of the terminal's colours, by name (the dashboard maps it; the core draws nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Colour {
    DarkGray,
    Blue,
    LightBlue,
    Cyan,
    Green,
    LightGreen,
    Yellow,
    LightRed,
}

impl Strategy {
    /// Every strategy, in the order the planner lists its choices and `p` cycles pins.
    pub const ALL: [StrategyInfo; 6] = [
        StrategyInfo {
            strategy: Strategy::None,
            name: "none",
            aliases: &[],
            holding: Holding::Replicated,
            owns_params: false,
            needs: Needs::Nothing,
            offloads_params: false,
            colour: Colour::DarkGray,
            baseline: None,
        },
        StrategyInfo {
            strategy: Strategy::Dp,
            name: "dp",
            aliases: &["ddp"],
            holding: Holding::Replicated,
            owns_params: true,
            needs: Needs::Nothing,
            offloads_params: true,
            colour: Colour::Blue,
            baseline: Some(["ddp", "ddp+ckpt"]),
        },
        StrategyInfo {
            strategy: Strategy::Zero1,
            name: "zero1",
            aliases: &[],
            holding: Holding::Zero1,
            owns_params: true,
            needs: Needs::Nothing,
            offloads_params: false,
            colour: Colour::Cyan,
            baseline: None,
        },
        StrategyInfo {
            strategy: Strategy::Zero2,
            name: "zero2",
            aliases: &[],
            holding: Holding::Zero2,
            owns_params: true,
            needs: Needs::Nothing,
            offloads_params: false,
            colour: Colour::Green,
            baseline: Some(["zero2", "zero2+ckpt"]),
        },
        StrategyInfo {
            strategy: Strategy::Zero3,
            name: "zero3",
            aliases: &["fsdp"],
            holding: Holding::Zero3,
            owns_params: true,
            needs: Needs::Nothing,
            offloads_params: true,
            colour: Colour::Yellow,
            baseline: Some(["fsdp", "fsdp+ckpt"]),
        },
        StrategyInfo {
            strategy: Strategy::Hsdp,
            name: "hsdp",
            aliases: &[],
            holding: Holding::Hybrid,
            owns_params: true,
            needs: Needs::SeveralNodes,
            offloads_params: true,
            colour: Colour::LightBlue,
            baseline: Some(["hsdp", "hsdp+ckpt"]),
        },
    ];

    /// This strategy's row of [`Strategy::ALL`].
    pub const fn info(self) -> &'static StrategyInfo {
        &Strategy::ALL[self as usize]
    }

    /// Whether every row of [`Strategy::ALL`] stands at its strategy's index.
    const fn rows_in_order() -> bool {
        let mut i = 0;
        while i < Strategy::ALL.len() {
            if Strategy::ALL[i].strategy as usize != i {
                return false;
            }
            i += 1;
        }
        true
    }

    pub fn as_str(self) -> &'static str {
        self.info().name
    }

    pub fn parse(s: &str) -> Option<Strategy> {
        Strategy::ALL
            .iter()
            .find(|i| i.name == s || i.aliases.contains(&s))
            .map(|i| i.strategy)
    }

    /// The strategies of ops that own parameters, in [`Strategy::ALL`]'s order.
    pub fn for_params() -> impl Iterator<Item = Strategy> {
        Strategy::ALL
            .iter()
            .filter(|i| i.owns_params)
            .map(|i| i.strategy)
    }

    /// Their names, for messages: `dp, zero1, zero2, zero3 or hsdp`.
    pub fn names_for_params() -> String {
        let names: Vec<&str> = Strategy::for_params().map(Strategy::as_str).collect();
        crate::text::or_list(&names)
    }
}

/// What of an op's state lives in host memory instead of the device's (ZeRO-Offload,
/// Colossal-AI's heterogeneous training, Hydra's spilling), on top of its sharding strategy.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub enum Offload {
    /// Everything on the device.
    #[default]
    #[serde(rename = "none")]
    None,
    /// `offload-opt`: the fp32 master copy and both Adam moments of the part this rank
    /// updates live in host memory and the AdamW step runs on the CPU; gradients are copied
    /// device → host and the updated weights host → device once a step.
    #[serde(rename = "offload-opt")]
    Opt,
    /// `offload-param`: as `Opt`, and the compute copy of the parameters lives in host memory
    /// too, fetched to the device for each forward and backward (the next op's fetch runs
    /// beside this op's compute where the device has a copy engine).
    #[serde(rename = "offload-param")]
    Param,
}

impl Offload {
    pub fn as_str(self) -> &'static str {
        match self {
            Offload::None => "none",
            Offload::Opt => "offload-opt",
            Offload::Param => "offload-param",
        }
    }

    pub fn parse(s: &str) -> Option<Offload> {
        Some(match s {
            "none" => Offload::None,
            "offload-opt" | "opt" => Offload::Opt,
            "offload-param" | "param" => Offload::Param,
            _ => return None,
        })
    }

    pub fn is_none(&self) -> bool {
        *self == Offload::None
    }
}

/// A strategy with OSDP's operator splitting: the op is cut into `split` slices along its input
/// features, of which the first `sharded` are ZeRO-3 sharded and the rest replicated; and
/// optionally offloaded to host memory (unsplit choices only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Choice {
    pub strategy: Strategy,
    pub split: u32,
    pub sharded: u32,
    #[serde(default, skip_serializing_if = "Offload::is_none")]
    pub offload: Offload,
}

impl Choice {
    pub const NONE: Choice = Choice::plain(Strategy::None);
    pub const DP: Choice = Choice::plain(Strategy::Dp);

    pub const fn plain(strategy: Strategy) -> Choice {
        let sharded = matches!(strategy, Strategy::Zero3) as u32;
        Choice {
            strategy,
            split: 1,
            sharded,
            offload: Offload::None,
        }
    }

    pub const fn zero3(split: u32, sharded: u32) -> Choice {
        Choice {
            strategy: Strategy::Zero3,
            split,
            sharded,
            offload: Offload::None,
        }
    }

    /// This choice with its state offloaded as `offload` says.
    pub const fn offloaded(self, offload: Offload) -> Choice {
        Choice { offload, ..self }
    }

    /// Whether the op's parameters are fetched whole for each use: gathered where sharded
    /// (zero3, hsdp) or copied from host memory where offloaded, unsplit — what a recomputed
    /// block can keep from its recomputation to its backward ([`crate::plan::kept_ops`]).
    pub fn fetches_whole(&self) -> bool {
        self.split <= 1
            && (self.strategy == Strategy::Hsdp
                || (self.strategy == Strategy::Zero3 && self.sharded >= 1)
                || self.offload == Offload::Param)
    }

    /// `zero3/4:3` for split ops, `zero2+offload-opt` for offloaded ones, the strategy name
    /// otherwise.
    pub fn label(&self) -> String {
        let base = if self.strategy == Strategy::Zero3 && self.split > 1 {
            format!("zero3/{}:{}", self.split, self.sharded)
        } else {
            self.strategy.as_str().to_string()
        };
        match self.offload {
            Offload::None => base,
            o => format!("{base}+{}", o.as_str()),
        }
    }

    /// [`Choice::label`] for narrow columns: `+ofl-opt` and `+ofl-par` for the offloads.
    pub fn short_label(&self) -> String {
        let full = self.label();
        match self.offload {
            Offload::None => full,
            Offload::Opt => full.replace("+offload-opt", "+ofl-opt"),
            Offload::Param => full.replace("+offload-param", "+ofl-par"),
        }
    }

    /// Parse a label ([`Choice::label`]): `dp`, `zero3/4:2`, `zero3+offload-param`, … (not
    /// checked against any op: see `plan::check_choice`).
    pub fn parse(s: &str) -> Option<Choice> {
        let (base, offload) = match s.split_once('+') {
            Some((b, o)) => (b, Offload::parse(o).filter(|o| !o.is_none())?),
            None => (s, Offload::None),
        };
        let choice = match base.split_once('/') {
            None => Strategy::parse(base).map(Choice::plain),
            Some(("zero3", rest)) => rest
                .split_once(':')
                .and_then(|(k, m)| Some(Choice::zero3(k.parse().ok()?, m.parse().ok()?))),
            Some(_) => None,
        }?;
        Some(choice.offloaded(offload))
    }
}

/// How one rank holds a unit of parameters — a whole tensor, or one column slice of a split
/// linear's weight: the unit the trainer shards, reduces and updates, and the cost model
/// prices state and optimizer time by ([`Choice::units`] says which units an op has).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Holding {
    /// Every rank holds all of it (dp, and the unsharded slices of a split op).
    Replicated,
    /// Optimizer states sharded.
    Zero1,
    /// Optimizer states and gradients sharded.
    Zero2,
    /// Everything sharded; gathered for use.
    Zero3,
    /// Everything sharded over the ranks of a node (hsdp), replicated across nodes.
    Hybrid,
}

impl Holding {
    /// How many ranks a unit held this way is shared among: a node's for [`Holding::Hybrid`],
    /// all of them otherwise. The share every rank holds, gathers and updates is of this many.
    pub fn shard_ranks(self, ranks: u64, ranks_per_node: u64) -> u64 {
        match self {
            Holding::Hybrid => ranks_per_node.clamp(1, ranks.max(1)),
            _ => ranks,
        }
    }

    /// Elements of a sharded unit of `numel` each of `ranks` holds: an equal share of the unit
    /// padded to a multiple of the ranks, so that collectives move equal pieces.
    pub fn share(numel: u64, ranks: u64) -> u64 {
        numel.div_ceil(ranks.max(1))
    }

    /// Elements of the unit this rank's optimizer updates (and keeps optimizer states for).
    pub fn updated(self, numel: u64, ranks: u64) -> u64 {
        match self {
            Holding::Replicated => numel,
            _ => Holding::share(numel, ranks),
        }
    }

    /// Elements of the unit's compute copy and gradient one of `ranks` holds all step: each
    /// whole or as this rank's padded share.
    pub fn held(self, numel: u64, ranks: u64) -> (u64, u64) {
        let share = Holding::share(numel, ranks);
        match self {
            Holding::Replicated | Holding::Zero1 => (numel, numel),
            Holding::Zero2 => (numel, share),
            Holding::Zero3 | Holding::Hybrid => (share, share),
        }
    }

    /// Bytes one of `ranks` holds all step for a unit of `numel` elements in `precision`:
    /// compute copy, gradient and optimizer state, each whole or as this rank's padded share.
    pub fn state_bytes(self, numel: u64, ranks: u64, precision: Precision) -> u64 {
        self.placed_bytes(numel, ranks, precision, Offload::None)
            .device
    }

    /// Whether an offloaded unit held this way moves its gradient to the host every
    /// micro-batch (ZeRO-Offload's way): where gradients are reduced to this rank's shard every
    /// micro-batch (zero2, zero3, hsdp), the shard goes to the host's fp32 buffer and is summed
    /// there; where they are synchronised once a step (dp, zero1), the gradient stays on the
    /// device until then.
    pub fn streams_grads(self) -> bool {
        matches!(self, Holding::Zero2 | Holding::Zero3 | Holding::Hybrid)
    }

    /// The device bytes of an offloaded unit's gradient of `grad_bytes`: none where it streams
    /// to the host ([`Holding::streams_grads`]).
    fn device_grad(self, grad_bytes: u64) -> u64 {
        if self.streams_grads() {
            0
        } else {
            grad_bytes
        }
    }

    /// [`Holding::state_bytes`] split between the device and host memory under `offload`.
    pub fn placed_bytes(
        self,
        numel: u64,
        ranks: u64,
        precision: Precision,
        offload: Offload,
    ) -> Placed {
        let (params, grads) = self.held(numel, ranks);
        let updated = self.updated(numel, ranks);
        let (param_b, grad_b) = (precision.param_bytes * params, precision.grad_bytes * grads);
        match offload {
            Offload::None => Placed {
                device: param_b + grad_b + precision.optimizer_bytes * updated,
                host: 0,
            },
            Offload::Opt => Placed {
                device: param_b + self.device_grad(grad_b),
                host: HOST_STATE_BYTES_PER_PARAM * updated,
            },
            Offload::Param => Placed {
                device: self.device_grad(grad_b),
                host: HOST_STATE_BYTES_PER_PARAM * updated + param_b,
            },
        }
    }
}

/// Bytes held all step on the device and in host memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Placed {
    pub device: u64,
    pub host: u64,
}

/// One unit of an op's parameter tensor under a choice (see [`Choice::units`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unit {
    /// `(j, k)`: the unit is column slice `j` of `k` equal ones; `None`: the whole tensor.
    pub slice: Option<(u32, u32)>,
    pub numel: u64,
    pub holding: Holding,
}

/// Whether splitting an op cuts its parameter `param` into column slices: only a linear's
/// weight is cut (along its input features); its other parameters stay whole.
pub fn cut_by_split(kind: OpKind, param: &str) -> bool {
    kind == OpKind::Linear && param == "weight"
}

impl Choice {
    /// The units a tensor of `numel` elements is held as under this choice. A tensor a split
    /// cuts ([`cut_by_split`]) becomes `split` equal column slices, the first `sharded` ZeRO-3
    /// and the others replicated; any other tensor is one unit held as the strategy says,
    /// except under a split, where it follows the majority of the slices (a split linear's
    /// bias is sharded when at least half its weight is).
    pub fn units(self, numel: u64, cut: bool) -> impl Iterator<Item = Unit> {
        let k = if cut { self.split.max(1) } else { 1 };
        let whole = if self.split > 1 && self.sharded * 2 < self.split {
            Holding::Replicated
        } else {
            self.strategy.info().holding
        };
        (0..k).map(move |j| match k {
            1 => Unit {
                slice: None,
                numel,
                holding: whole,
            },
            _ => Unit {
                slice: Some((j, k)),
                numel: numel / u64::from(k),
                holding: if j < self.sharded {
                    Holding::Zero3
                } else {
                    Holding::Replicated
                },
            },
        })
    }
}

/// Every choice the planner may make for an op on `m`: `None` for parameter-free ops; every
/// strategy of [`Strategy::ALL`] for ops with parameters, but those the layout cannot run
/// (HSDP on one node); and for splittable ops
/// ZeRO-3 split into `k` = 2, 4, … ≤ `max_split` slices with 1..=k of them sharded.
pub fn choices(base: &OpBase, m: &Machine, max_split: u32) -> Vec<Choice> {
    if base.params == 0 {
        return vec![Choice::NONE];
    }
    let mut out: Vec<Choice> = Strategy::for_params()
        .filter(|&s| m.refuses(s).is_none())
        .map(Choice::plain)
        .collect();
    if m.offers_offload() {
        let unsplit: Vec<Choice> = out.clone();
        for c in unsplit {
            out.extend(
                [Offload::Opt, Offload::Param]
                    .into_iter()
                    .filter(|&o| offload_applies(c.strategy, o))
                    .map(|o| c.offloaded(o)),
            );
        }
    }
    if base.splittable {
        let mut k = 2;
        while k <= max_split {
            out.extend((1..=k).map(|s| Choice::zero3(k, s)));
            k *= 2;
        }
    }
    out
}

/// Whether `offload` combines with `strategy`: optimizer state may leave the device under
/// any strategy that owns parameters; the compute copy only where each rank updates exactly
/// what it holds (dp, zero3, hsdp) — under zero1/zero2 the updated shard would have to be
/// gathered back into a host copy.
pub fn offload_applies(strategy: Strategy, offload: Offload) -> bool {
    match offload {
        Offload::None => true,
        _ if !strategy.info().owns_params => false,
        Offload::Opt => true,
        Offload::Param => strategy.info().offloads_params,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::fixtures::{linear_base, machine, with_host};
    use crate::cost::Precision;

    #[test]
    fn a_split_weight_is_held_as_slices_and_its_bias_follows_the_majority() {
        let holdings = |c: Choice, cut: bool| c.units(800, cut).collect::<Vec<Unit>>();
        let unit = |slice, numel, holding| Unit {
            slice,
            numel,
            holding,
        };
        use Holding::{Replicated as R, Zero3 as Z};
        assert_eq!(
            holdings(Choice::zero3(4, 1), true),
            vec![
                unit(Some((0, 4)), 200, Z),
                unit(Some((1, 4)), 200, R),
                unit(Some((2, 4)), 200, R),
                unit(Some((3, 4)), 200, R)
            ]
        );
        // The bias: replicated under a sharded minority, sharded from half up.
        assert_eq!(
            holdings(Choice::zero3(4, 1), false),
            vec![unit(None, 800, R)]
        );
        assert_eq!(
            holdings(Choice::zero3(4, 2), false),
            vec![unit(None, 800, Z)]
        );
        assert_eq!(
            holdings(Choice::zero3(1, 1), true),
            vec![unit(None, 800, Z)]
        );
        assert_eq!(holdings(Choice::DP, true), vec![unit(None, 800, R)]);
        // State per rank: whole, or a share padded to the ranks (7 elements over 2: 4 each).
        let fp32 = Precision::FP32;
        assert_eq!(Holding::Replicated.state_bytes(7, 2, fp32), 16 * 7);
        assert_eq!(Holding::Zero1.state_bytes(7, 2, fp32), 8 * 7 + 8 * 4);
        assert_eq!(Holding::Zero2.state_bytes(7, 2, fp32), 4 * 7 + 12 * 4);
        assert_eq!(Holding::Zero3.state_bytes(7, 2, fp32), 16 * 4);
    }

    #[test]
    fn choices_cover_the_osdp_space() {
        let b = linear_base(1000);
        let m = machine(8);
        let c = choices(&b, &m, 4);
        // dp, zero1, zero2, zero3; then k = 2 with 1..=2 sharded, k = 4 with 1..=4.
        assert_eq!(c.len(), 4 + 2 + 4);
        assert!(c.contains(&Choice::zero3(4, 3)));
        let norm = OpBase {
            splittable: false,
            ..linear_base(1000)
        };
        assert_eq!(choices(&norm, &m, 8).len(), 4);
        let free = OpBase {
            params: 0,
            ..linear_base(0)
        };
        assert_eq!(choices(&free, &m, 8), vec![Choice::NONE]);
    }

    #[test]
    fn offload_is_offered_only_with_a_host_and_only_where_it_applies() {
        let base = linear_base(1 << 20);
        let none = choices(&base, &machine(4), 4);
        assert!(none.iter().all(|c| c.offload.is_none()));
        let some = choices(&base, &with_host(machine(4)), 4);
        let offloaded: Vec<String> = some
            .iter()
            .filter(|c| !c.offload.is_none())
            .map(Choice::label)
            .collect();
        assert_eq!(
            offloaded,
            [
                "dp+offload-opt",
                "dp+offload-param",
                "zero1+offload-opt",
                "zero2+offload-opt",
                "zero3+offload-opt",
                "zero3+offload-param"
            ]
        );
        for c in &some {
            assert_eq!(Choice::parse(&c.label()), Some(*c), "{}", c.label());
        }
        assert_eq!(Choice::parse("zero3+offload"), None);
        assert_eq!(Choice::parse("dp+none"), None);
        let why = machine(4)
            .refuses_choice(Choice::DP.offloaded(Offload::Opt))
            .unwrap();
        assert!(why.contains("no `host` figures"), "{why}");
    }
}
