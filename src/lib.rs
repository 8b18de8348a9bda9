//! osdp-tui: plan and run Optimal Sharded Data Parallel training from a terminal dashboard.
//!
//! The app crate: the CLI ([`cli`]), the dashboard ([`tui`]), the NVML monitor ([`monitor`]),
//! the worker supervisor ([`supervisor`]) and its lifeline to each worker ([`lifeline`]). The
//! model, cluster, prices, planner and run protocol live in `osdp-core`; the libtorch trainer
//! in `osdp-train` (feature `train`). Both are re-exported under their old paths so a script
//! or test reads `osdp_tui::plan` as before.

pub use osdp_core::{cluster, cost, input, lock, model, plan, published, run, text, units};
#[cfg(feature = "train")]
pub use osdp_train as train;

pub mod cli;
pub mod failure;
pub mod lifeline;
pub mod monitor;
pub mod report;
pub mod supervisor;
pub mod tui;
