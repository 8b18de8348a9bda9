//! Link settings for libtorch (feature `train`), see build-support/libtorch_link.rs: only
//! for the trainer binary and the integration tests, which use the trainer crate; `osdp-tui`
//! itself links no libtorch.

include!("build-support/libtorch_link.rs");

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=build-support/libtorch_link.rs");
    let _ = link_libtorch(&["-bin=osdp-tui-trainer", "-tests"]);
}
