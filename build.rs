//! Link settings for the `train` feature.
//!
//! libtorch's CUDA library is only reached through static initialisers, so a linker that
//! drops "unused" shared libraries (`--as-needed`, the default on Debian/Ubuntu) silently
//! leaves CUDA unavailable: `--no-as-needed` keeps it. The rpath lets the binary find the
//! libtorch it was built against without LD_LIBRARY_PATH.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if let Ok(lib_dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");
        // Where the GPU build looks for pip's NCCL (beside this libtorch) when it must.
        println!("cargo:rustc-env=OSDP_TORCH_LIB_DIR={lib_dir}");
    }
}
