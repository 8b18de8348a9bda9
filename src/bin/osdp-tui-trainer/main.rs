//! `osdp-tui-trainer`: the commands that run libtorch (`train`, `calibrate`, `validate`, `eval`, `export-hf`), which
//! `osdp-tui` hands over to (it execs this binary with its own arguments). Every other command
//! works here too, through the same command line, so a worker can be started as either.
//!
//! Only this binary links libtorch: the planner, the dashboard and `status` stay small.

mod measure;
mod train;
mod weights;

fn main() -> std::process::ExitCode {
    osdp_train::keep_freed_memory();
    osdp_train::allocator_defaults();
    osdp_tui::cli::main_with(Some(&osdp_tui::cli::Trainer {
        train: train::train,
        calibrate: measure::calibrate,
        validate: measure::validate,
        eval: weights::eval,
        export_hf: weights::export_hf,
    }))
}
