//! Link settings for the `train` feature, and the CUDA allocator shim for `cuda`.
//!
//! libtorch's CUDA library is reached only through static initialisers, so a linker that drops
//! "unused" shared libraries (`--as-needed`, the default on Debian/Ubuntu) silently leaves
//! CUDA unavailable. rustc places link arguments *after* the libraries torch-sys names, so a
//! bare `-Wl,--no-as-needed` comes too late: the CUDA libraries are named again here, between
//! `--no-as-needed` and `--as-needed`, which makes them NEEDED whatever the linker's default.
//! The rpath lets the binary find the libtorch it was built against without LD_LIBRARY_PATH.
use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/train/cuda_stats.cpp");
    println!("cargo::rustc-check-cfg=cfg(osdp_cuda_stats)");
    let Ok(lib_dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        return;
    };
    let lib_dir = PathBuf::from(lib_dir);
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
    // Where the GPU build looks for pip's NCCL (beside this libtorch) when it must.
    println!("cargo:rustc-env=OSDP_TORCH_LIB_DIR={}", lib_dir.display());
    let cuda_libs: Vec<&str> = ["torch_cuda", "c10_cuda"]
        .into_iter()
        .filter(|l| lib_dir.join(format!("lib{l}.so")).exists())
        .collect();
    if cuda_libs.is_empty() {
        // A CPU-only libtorch: `train --device cuda` says so when it starts.
        return;
    }
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
    for l in &cuda_libs {
        println!("cargo:rustc-link-arg=-l{l}");
    }
    println!("cargo:rustc-link-arg=-Wl,--as-needed");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() && cuda_libs.contains(&"c10_cuda") {
        build_allocator_shim(&lib_dir);
    }
}

/// The CUDA caching allocator's statistics (allocated and reserved bytes, current and peak)
/// are C++ inline functions with no C binding in tch; a few lines of C++ reach them. The shim
/// needs the CUDA runtime headers pip's CUDA wheels (or a toolkit) bring; without them the
/// build goes on and the trainer reports the allocator's figures as not available.
fn build_allocator_shim(lib_dir: &Path) {
    let torch_include = lib_dir.join("../include");
    // A toolkit's include directory is whole; pip's runtime wheel lacks the `crt/` headers
    // `cuda_runtime.h` includes, which the triton wheel PyTorch depends on brings.
    let whole =
        |d: &PathBuf| d.join("cuda_runtime_api.h").exists() && d.join("crt/host_config.h").exists();
    let site = lib_dir.join("../..");
    let toolkit = [
        PathBuf::from(std::env::var("CUDA_HOME").unwrap_or_default()).join("include"),
        PathBuf::from("/usr/local/cuda/include"),
    ]
    .into_iter()
    .find(whole);
    let pip = [
        site.join("nvidia/cu13/include"),
        site.join("nvidia/cuda_runtime/include"),
    ]
    .into_iter()
    .find(|d| d.join("cuda_runtime_api.h").exists());
    let crt = site.join("triton/backends/nvidia/include");
    let cuda_include: Option<Vec<PathBuf>> = match (toolkit, pip) {
        (Some(t), _) => Some(vec![t]),
        (None, Some(p)) if whole(&crt) => Some(vec![p, crt]),
        _ => None,
    };
    let Some(cuda_include) = cuda_include else {
        println!(
            "cargo:warning=no CUDA runtime headers found (pip's nvidia-cuda-runtime or CUDA_HOME): \
             the trainer will not report the CUDA allocator's peak"
        );
        return;
    };
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(&torch_include)
        .include(torch_include.join("torch/csrc/api/include"))
        .includes(&cuda_include)
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .file("src/train/cuda_stats.cpp")
        .compile("osdp_cuda_stats");
    println!("cargo:rustc-cfg=osdp_cuda_stats");
}
