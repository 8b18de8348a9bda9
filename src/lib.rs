//! osdp-tui: plan and run Optimal Sharded Data Parallel training from a terminal dashboard.
//!
//! The app crate: the CLI ([`cli`]), the dashboard ([`tui`]), run directories and locks
//! ([`run`]), the NVML monitor ([`monitor`]), the worker supervisor ([`supervisor`]) and its
//! lifeline to each worker ([`lifeline`]). The model, cluster, prices, planner and worker
//! protocol are `osdp_core`'s; the libtorch trainer is `osdp_train` (feature `train`): paths
//! name the crate they come from.

pub mod cli;
pub mod env;
pub mod failure;
pub mod lifeline;
pub mod monitor;
pub mod report;
pub mod run;
pub mod supervisor;
pub mod tui;
