//! The trainer's link settings (see build-support/libtorch_link.rs), where the GPU build looks
//! for pip's NCCL, and the CUDA allocator shim for feature `cuda`.
use std::path::{Path, PathBuf};

include!("../../build-support/libtorch_link.rs");

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=../../build-support/libtorch_link.rs");
    println!("cargo:rerun-if-changed=src/cuda_stats.cpp");
    println!("cargo:rerun-if-changed=src/aten_shim.cpp");
    println!("cargo::rustc-check-cfg=cfg(osdp_cuda_stats)");
    let Some((lib_dir, cuda)) = link_libtorch(&[""]) else {
        return;
    };
    build_aten_shim(&lib_dir);
    if cuda && std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        build_allocator_shim(&lib_dir);
    }
}

/// libtorch kernels tch does not bind (fused AdamW, a list's norm, the norms' backward
/// kernels): C++ against libtorch's own headers, no CUDA headers needed, so every build has it.
fn build_aten_shim(lib_dir: &Path) {
    against_libtorch(lib_dir)
        .file("src/aten_shim.cpp")
        .compile("osdp_aten_shim");
}

/// A C++17 build against libtorch's headers, with the C++ ABI libtorch was built with.
fn against_libtorch(lib_dir: &Path) -> cc::Build {
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(lib_dir.join("../include"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"));
    build
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
    against_libtorch(lib_dir)
        .include(torch_include.join("torch/csrc/api/include"))
        .includes(&cuda_include)
        .file("src/cuda_stats.cpp")
        .compile("osdp_cuda_stats");
    println!("cargo:rustc-cfg=osdp_cuda_stats");
}
