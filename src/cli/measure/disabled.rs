//! `calibrate` and `validate` in a build without the trainer: each says how to get it.

use super::*;

fn needs_trainer(what: &str) -> Failure {
    Failure::input(format!(
        "{what} times the trainer's kernels, and this osdp-tui was built without them; build it \
         with `. scripts/libtorch-env.sh && cargo build --release --features train`"
    ))
}

pub fn calibrate(args: CalibrateArgs) -> Result<(), Failure> {
    if args.device == DeviceArg::Cuda {
        return Err(no_cuda());
    }
    Err(needs_trainer("calibrate"))
}

pub fn validate(_args: ValidateArgs) -> Result<(), Failure> {
    Err(needs_trainer("validate"))
}
