//! The binary's link settings for libtorch (feature `train`): see
//! build-support/libtorch_link.rs.

include!("build-support/libtorch_link.rs");

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=build-support/libtorch_link.rs");
    let _ = link_libtorch();
}
