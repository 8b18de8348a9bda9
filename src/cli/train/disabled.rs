//! `train` in a build without the trainer: it checks the arguments, then says how to get it.

use super::*;

pub fn train(args: TrainArgs) -> Result<(), Failure> {
    args.check()?;
    Err(Failure::input(
        "this osdp-tui was built without the trainer; build it with \
         `. scripts/libtorch-env.sh && cargo build --release --features train`",
    ))
}
