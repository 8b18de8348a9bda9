//! osdp-tui: plan and run Optimal Sharded Data Parallel training from a terminal dashboard.
//!
//! Data flows one way: model description ([`model`]) and cluster layout ([`cluster`]) → prices →
//! plan → screen or training run. `model` and `cluster` never touch a GPU or the terminal.

pub mod cli;
pub mod cluster;
pub mod cost;
pub mod input;
pub mod lock;
pub mod model;
pub mod monitor;
pub mod plan;
pub mod published;
pub mod report;
pub mod run;
pub mod text;
#[cfg(feature = "train")]
pub mod train;
pub mod tui;
pub mod units;
