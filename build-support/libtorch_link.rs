// Included by the build scripts of the trainer crate and of the app (`include!`): link
// arguments reach only the package whose build script prints them, so both print them.
//
// libtorch's CUDA library is reached only through static initialisers, so a linker that drops
// "unused" shared libraries (`--as-needed`, the default on Debian/Ubuntu) silently leaves
// CUDA unavailable. rustc places link arguments *after* the libraries torch-sys names, so a
// bare `-Wl,--no-as-needed` comes too late: the CUDA libraries are named again here, between
// `--no-as-needed` and `--as-needed`, which makes them NEEDED whatever the linker's default.
// The rpath lets a binary find the libtorch it was built against without LD_LIBRARY_PATH.
//
// `targets` names the link-argument keys of the targets that link libtorch: `""` (every target
// of the package) for the trainer crate; for the app only the trainer binary and the
// integration tests, so that `osdp-tui` itself never loads libtorch.

/// Print the link arguments for libtorch to the `cargo:rustc-link-arg{key}` of each target
/// key; its library directory and whether it has CUDA, or `None` when this build has no
/// libtorch (torch-sys not in the graph).
fn link_libtorch(targets: &[&str]) -> Option<(std::path::PathBuf, bool)> {
    let lib_dir = std::path::PathBuf::from(std::env::var("DEP_TCH_LIBTORCH_LIB").ok()?);
    let arg = |a: &str| {
        for t in targets {
            println!("cargo:rustc-link-arg{t}={a}");
        }
    };
    arg(&format!("-Wl,-rpath,{}", lib_dir.display()));
    // The libtorch this build links (the GPU build looks for pip's NCCL beside it).
    println!("cargo:rustc-env=OSDP_TORCH_LIB_DIR={}", lib_dir.display());
    let cuda_libs: Vec<&str> = ["torch_cuda", "c10_cuda"]
        .into_iter()
        .filter(|l| lib_dir.join(format!("lib{l}.so")).exists())
        .collect();
    if cuda_libs.is_empty() {
        // A CPU-only libtorch: `train --device cuda` says so when it starts.
        return Some((lib_dir, false));
    }
    arg("-Wl,--no-as-needed");
    for l in &cuda_libs {
        arg(&format!("-l{l}"));
    }
    arg("-Wl,--as-needed");
    Some((lib_dir, cuda_libs.contains(&"c10_cuda")))
}
