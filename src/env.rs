//! Every environment variable the app reads, in one place. The launcher's (torchrun's,
//! Slurm's) are the trainer's to read (`osdp_train::env`); the app only sets variables for
//! the workers it starts (`supervisor`).

/// no-color.org: set and not empty, the dashboard draws without colour.
pub const NO_COLOR: &str = "NO_COLOR";

/// Whether `NO_COLOR` asks for no colours.
pub fn no_color() -> bool {
    std::env::var_os(NO_COLOR).is_some_and(|v| !v.is_empty())
}
