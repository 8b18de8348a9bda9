//! What runs the plan: osdp-tui's own trainer, which runs every choice the cost model prices,
//! or PyTorch FSDP2 (`fully_shard` per module, in the user's own training loop), which
//! expresses fewer. A [`Target`] restricts the planner's choices to what it can run; within
//! them the planner stays exact.

use serde::{Deserialize, Serialize};

use super::{self as cost, Choice, Machine, Offload, OpBase, Strategy};

/// What will run the plan.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    /// osdp-tui's trainer (`osdp-tui train`): every choice.
    #[default]
    Osdp,
    /// PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`) through `osdp_torch.apply_plan`:
    /// per module zero3 (`reshard_after_forward=True`), zero2 (`False`), dp (a mesh whose shard
    /// dimension is 1) or hsdp (a 2-D mesh), whole (no operator splitting), offloaded only as
    /// `+offload-param` (`CPUOffloadPolicy` moves parameters, gradients and the optimizer step
    /// together).
    Fsdp2,
}

impl Target {
    /// Every target, in the order `--target` lists them.
    pub const ALL: [Target; 2] = [Target::Osdp, Target::Fsdp2];

    /// Its name on the command line and in exports.
    pub fn as_str(self) -> &'static str {
        match self {
            Target::Osdp => "osdp",
            Target::Fsdp2 => "fsdp2",
        }
    }

    /// Whether this is osdp-tui's own trainer (plan files leave that target out).
    pub fn is_osdp(&self) -> bool {
        *self == Target::Osdp
    }

    pub fn parse(s: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.as_str() == s)
    }

    /// Whether this target can run `choice`; why not, in words that name the choice.
    pub fn allows(self, c: Choice) -> Result<(), String> {
        if self == Target::Osdp {
            return Ok(());
        }
        if c.split > 1 {
            return Err(format!(
                "{} splits the operator, which FSDP2 cannot express (it shards whole modules)",
                c.label()
            ));
        }
        if c.strategy == Strategy::Zero1 {
            return Err(
                "zero1 (sharded optimizer state only) has no FSDP2 equivalent: FSDP2 shards \
                 parameters and gradients with it"
                    .into(),
            );
        }
        if c.offload == Offload::Opt {
            return Err(format!(
                "{} offloads the optimizer state alone; FSDP2's CPUOffloadPolicy moves \
                 parameters, gradients and the optimizer step together (+offload-param)",
                c.label()
            ));
        }
        Ok(())
    }

    /// The choices the planner may make for an op on `m` under this target: those of
    /// [`cost::choices`] it [allows](Target::allows).
    pub fn choices(self, base: &OpBase, m: &Machine, max_split: u32) -> Vec<Choice> {
        let mut all = cost::choices(base, m, max_split);
        all.retain(|&c| self.allows(c).is_ok());
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::read_layout;
    use crate::model::read_model;
    use std::path::Path;

    #[test]
    fn fsdp2_keeps_whole_modules_and_parameter_offload_only() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let model = read_model(&root.join("sample-models/tiny-gpt2.json")).unwrap();
        let layout = read_layout(&root.join("layouts/cpu.json")).unwrap();
        let m = Machine::new(&layout, &model);
        let bases = cost::op_bases(&model, &m, 1);
        let c_fc = model
            .ops
            .iter()
            .position(|o| o.id == "h0.mlp.c_fc")
            .unwrap();
        let labels = |t: Target| -> Vec<String> {
            t.choices(&bases[c_fc], &m, 4)
                .iter()
                .map(Choice::label)
                .collect()
        };
        assert_eq!(
            labels(Target::Fsdp2),
            [
                "dp",
                "zero2",
                "zero3",
                "dp+offload-param",
                "zero3+offload-param"
            ]
        );
        assert_eq!(
            labels(Target::Osdp).len(),
            cost::choices(&bases[c_fc], &m, 4).len()
        );
        let why = Target::Fsdp2.allows(Choice::zero3(4, 2)).unwrap_err();
        assert!(why.starts_with("zero3/4:2 splits the operator"), "{why}");
        let why = Target::Fsdp2
            .allows(Choice::plain(Strategy::Zero2).offloaded(Offload::Opt))
            .unwrap_err();
        assert!(why.starts_with("zero2+offload-opt offloads"), "{why}");
        assert!(Target::Fsdp2.allows(Choice::NONE).is_ok());
        assert_eq!(Target::parse("fsdp2"), Some(Target::Fsdp2));
        assert_eq!(Target::parse("fsdp"), None);
    }
}
