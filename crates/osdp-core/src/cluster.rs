//! Cluster layouts: how many devices, how much memory and compute each has, and the links
//! between them. Every figure carries a `source` note so a reader can tell a datasheet value
//! from a measurement or an estimate.

pub mod calibration;
pub mod known;
mod layout;

pub use calibration::Calibration;
pub use layout::{
    read_layout, validate_layout, DeviceKind, DeviceSpec, Efficiency, Figure, HostSpec, Layout,
    LinkKind, LinkSpec, Rates, ReduceDType, HOST_BUDGET_SHARE, LAYOUT_FORMAT_VERSION,
};
