//! The core of osdp-tui: what a model is ([`model`]), what a cluster is ([`cluster`]), what a
//! way of running each operator costs ([`cost`]), the exact planner ([`plan`]), and the
//! protocol a trainer writes and a dashboard reads ([`protocol`]).
//!
//! Data flows one way: model and layout → prices → plan. Nothing here touches a GPU, libtorch,
//! the terminal, processes or run directories; the trainer (`osdp-train`) and the app
//! (`osdp-tui`) build on this crate and the compiler keeps it from reaching back.

pub mod cluster;
pub mod cost;
pub mod input;
pub mod model;
pub mod plan;
pub mod protocol;
pub mod text;
pub mod units;
