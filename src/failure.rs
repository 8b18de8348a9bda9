//! How a command fails: a one-line message and the exit code it maps to (2 for bad input, 1
//! for a write that failed, 3 for "no plan fits"). Commands and reports return it; `cli::main`
//! prints it.

use std::path::Path;

/// A failure with the exit code it maps to.
pub struct Failure {
    pub code: u8,
    pub message: String,
}

impl Failure {
    pub fn input(e: impl std::fmt::Display) -> Self {
        Failure {
            code: 2,
            message: e.to_string(),
        }
    }

    pub fn output(path: &Path, e: std::io::Error) -> Self {
        Failure {
            code: 1,
            message: format!("{}: cannot write: {e}", path.display()),
        }
    }
}
