//! Datasheet figures of common GPUs, and a layout for the GPUs NVML finds on this machine.

use super::{
    DeviceKind, DeviceSpec, Figure, Layout, LinkKind, LinkSpec, Rates, LAYOUT_FORMAT_VERSION,
};

/// Dense peak rates and bandwidths of one GPU model (no sparsity).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KnownGpu {
    /// Matched case-insensitively against NVML's device name; the first match wins.
    pub pattern: &'static str,
    pub bf16_tflops: Option<f64>,
    pub fp16_tflops: f64,
    pub fp32_tflops: f64,
    pub memory_gb_per_s: f64,
    /// NCCL bus bandwidth between GPUs of one node, GB/s.
    pub link_gb_per_s: f64,
    pub link: LinkKind,
    pub source: &'static str,
    /// What training kernels reach of those peaks on this generation.
    pub efficiency: &'static Generation,
    /// The shipped one-GPU layout of this GPU (`layouts/NAME.json`), which `calibrate --device
    /// cuda` completes with what it measures; `None`: none ships.
    pub single_gpu_layout: Option<&'static str>,
}

/// A fraction with where it came from.
#[derive(Debug, PartialEq)]
pub struct Sourced {
    pub value: f64,
    pub source: &'static str,
}

/// Kernel efficiencies of a GPU generation (fractions of the datasheet peaks), with sources.
#[derive(Debug, PartialEq)]
pub struct Generation {
    pub name: &'static str,
    /// Where the figures come from, in a few words.
    pub summary: &'static str,
    pub matmul: Sourced,
    /// Features at which a GEMM's efficiency is half the large-GEMM one (`k / (k + this)`).
    pub matmul_half_width: Sourced,
    pub attention_forward: Sourced,
    pub attention_backward: Sourced,
    pub memory: Sourced,
    /// What a 16-bit GEMM reaches of the peak when one of its dimensions is not a multiple of 8
    /// (a 50,257-word vocabulary's LM head): the tensor-core kernels want 16-byte-aligned rows
    /// ("Tensor Core requirements", NVIDIA's Matrix Multiplication Background guide), and cuBLAS
    /// falls back to slower ones. 0 where it was not measured: no penalty is priced.
    pub unaligned_matmul: Sourced,
    /// Whether FlashAttention-2's fused kernels run on this generation. Without them an
    /// executor falls back to materialised (or memory-efficient) attention, which computes the
    /// masked half of a causal score matrix too: the cost model prices attention at its full
    /// FLOPs there.
    pub flash_attention: bool,
    /// Whether PyTorch's `scaled_dot_product_attention` runs cuDNN's attention kernels here
    /// rather than FlashAttention-2's: PyTorch 2.10 and later put cuDNN first on sm90 and sm100
    /// once the cuDNN it loads is newer than 9.15 (`check_prefer_cudnn_attention` in
    /// aten/src/ATen/native/transformers/cuda/sdp_utils.cpp; opt out with
    /// `TORCH_CUDNN_SDPA_DEPRIORITIZED`), and torch 2.11's wheels bundle cuDNN 9.19. osdp-tui's
    /// trainer links that torch, and a user's FSDP2 code on it runs the same kernels
    /// ([`crate::cost::Machine::cudnn_attention`]).
    pub cudnn_attention: bool,
}

/// FlashAttention-2 runs on Ampere, Ada and Hopper only: "FlashAttention-2 currently supports:
/// Ampere, Ada, or Hopper GPUs (e.g., A100, RTX 3090, RTX 4090, H100). Support for Turing GPUs
/// (T4, RTX 2080) is coming soon, please use FlashAttention 1.x for Turing GPUs for now"
/// (Dao-AILab/flash-attention README, v2.x); Volta (V100) has no FlashAttention at all.
/// PyTorch's SDPA picks its memory-efficient kernel there, which skips no masked tiles' FLOPs.
pub const FLASH_ATTENTION_SOURCE: &str =
    "Dao-AILab/flash-attention README: FlashAttention-2 supports Ampere, Ada and Hopper GPUs";

/// Where the fitted figures come from.
const FIT: &str = "fitted 2026-11-25 to 24 published single-node llm-foundry FSDP runs on A100 \
                   and H100 (docs/published-runs.md; `cargo run --release --example \
                   published-runs -- --fit`)";

/// The attention figures are effective ones: fitted with FlashAttention-2's forward/backward
/// ratio kept, they also carry the per-token work around the kernel (masking, softmax
/// statistics, layout copies) that the graph does not list.
const FIT_ATTENTION: &str = "fitted 2026-11-25 to 24 published single-node llm-foundry FSDP \
                             runs (docs/published-runs.md), keeping FlashAttention-2's \
                             backward/forward ratio (arXiv:2307.08691, arXiv:2407.08608)";

const FITTED_HALF_WIDTH: Sourced = Sourced {
    value: 592.0,
    source: FIT,
};

const FITTED_MEMORY: Sourced = Sourced {
    value: 0.8,
    source: "estimate: element-wise kernels reach ~80 % of HBM bandwidth",
};

/// Hopper (H100, H200): bf16 GEMMs of transformer shapes reach ~70 % of the datasheet's
/// 989 TFLOP/s in FSDP training.
pub const HOPPER: Generation = Generation {
    name: "Hopper",
    summary: "Hopper efficiencies fitted to published H100 training runs",
    matmul: Sourced {
        value: 0.714,
        source: FIT,
    },
    matmul_half_width: FITTED_HALF_WIDTH,
    attention_forward: Sourced {
        value: 0.188,
        source: FIT_ATTENTION,
    },
    attention_backward: Sourced {
        value: 0.152,
        source: FIT_ATTENTION,
    },
    memory: FITTED_MEMORY,
    unaligned_matmul: Sourced {
        value: 0.12,
        source: "measured on one H200, 2026-11-28 (docs/benchmarks.md, torch.profiler of PyTorch \
                 eager's gpt2-medium step): the 50,257-wide LM head's three bf16 GEMMs ran on \
                 cutlass_75 kernels, 12.65 TFLOP in 106 ms, 119 TFLOP/s of 989",
    },
    flash_attention: true,
    cudnn_attention: true,
};

/// Not measured on this generation: no penalty priced.
const UNALIGNED_NOT_MEASURED: Sourced = Sourced {
    value: 0.0,
    source: "not measured on this generation: a GEMM with a dimension not a multiple of 8 is \
             priced as an aligned one",
};

/// Ampere (A100, A10): GEMMs reach ~90 % of the A100's 312 TFLOP/s.
pub const AMPERE: Generation = Generation {
    name: "Ampere",
    summary: "Ampere efficiencies fitted to published A100 training runs",
    matmul: Sourced {
        value: 0.917,
        source: FIT,
    },
    matmul_half_width: FITTED_HALF_WIDTH,
    attention_forward: Sourced {
        value: 0.331,
        source: FIT_ATTENTION,
    },
    attention_backward: Sourced {
        value: 0.279,
        source: FIT_ATTENTION,
    },
    memory: FITTED_MEMORY,
    unaligned_matmul: UNALIGNED_NOT_MEASURED,
    flash_attention: true,
    cudnn_attention: false,
};

const GENERIC: &str = "generic estimate, not fitted to this GPU (calibrate measures it)";

/// Generations without published training figures here (Ada, Turing, Volta): the generic
/// fractions the cost model always used.
pub const OTHER: Generation = Generation {
    name: "other",
    summary: "generic efficiencies (no published runs fitted for this GPU)",
    matmul: Sourced {
        value: 0.70,
        source: GENERIC,
    },
    matmul_half_width: Sourced {
        value: 0.0,
        source: GENERIC,
    },
    attention_forward: Sourced {
        value: 0.50,
        source: GENERIC,
    },
    attention_backward: Sourced {
        value: 0.40,
        source: GENERIC,
    },
    memory: Sourced {
        value: 0.80,
        source: GENERIC,
    },
    unaligned_matmul: UNALIGNED_NOT_MEASURED,
    flash_attention: true,
    cudnn_attention: false,
};

/// Volta (V100) and Turing (TITAN RTX, T4): the generic fractions, the narrow-GEMM penalty
/// fitted on Ampere and Hopper (no published run of these GPUs is fitted; a GEMM with a narrow
/// side runs short tiles on any tensor-core generation), and no FlashAttention-2
/// ([`FLASH_ATTENTION_SOURCE`]): causal attention is priced at its full FLOPs.
pub const VOLTA_TURING: Generation = Generation {
    name: "Volta/Turing",
    summary: "generic efficiencies with Ampere/Hopper's narrow-GEMM penalty, no FlashAttention-2 on Volta/Turing (Dao-AILab/flash-attention README)",
    flash_attention: false,
    cudnn_attention: false,
    matmul_half_width: Sourced {
        value: FITTED_HALF_WIDTH.value,
        source: "assumed: the half width fitted on Ampere and Hopper (not fitted to a Volta or \
                 Turing run)",
    },
    ..OTHER
};

/// The H100 SXM's row, which the H800 and H20 (export variants of the same die) start from.
const H100_SXM: KnownGpu = KnownGpu {
    pattern: "H100",
    bf16_tflops: Some(989.0),
    fp16_tflops: 989.0,
    fp32_tflops: 66.9,
    memory_gb_per_s: 3350.0,
    link_gb_per_s: 370.0,
    link: LinkKind::Nvlink,
    single_gpu_layout: Some("h100-1x"),
    efficiency: &HOPPER,
    source: "NVIDIA H100 SXM datasheet",
};

/// Most specific names first.
/// The A100s' rows, which the A800s (the same part, a slower NVLink) start from.
const A100_PCIE: KnownGpu = KnownGpu {
    pattern: "A100-PCIE",
    bf16_tflops: Some(312.0),
    fp16_tflops: 312.0,
    fp32_tflops: 19.5,
    memory_gb_per_s: 1935.0,
    link_gb_per_s: 12.0,
    link: LinkKind::Pcie,
    single_gpu_layout: None,
    efficiency: &AMPERE,
    source: "NVIDIA A100 PCIe datasheet",
};
const A100_SXM: KnownGpu = KnownGpu {
    pattern: "A100",
    bf16_tflops: Some(312.0),
    fp16_tflops: 312.0,
    fp32_tflops: 19.5,
    memory_gb_per_s: 2039.0,
    link_gb_per_s: 200.0,
    link: LinkKind::Nvlink,
    single_gpu_layout: None,
    efficiency: &AMPERE,
    source: "NVIDIA A100 SXM datasheet",
};

/// The V100 SXM2 module's row (DGX-1, DGX-2), which the other V100 parts start from.
const V100_SXM: KnownGpu = KnownGpu {
    pattern: "V100",
    bf16_tflops: None,
    fp16_tflops: 125.0,
    fp32_tflops: 15.7,
    memory_gb_per_s: 900.0,
    link_gb_per_s: 130.0,
    link: LinkKind::Nvlink,
    single_gpu_layout: Some("v100-dgx2-1x"),
    efficiency: &VOLTA_TURING,
    source: "NVIDIA V100 SXM2 datasheet",
};

pub const KNOWN_GPUS: &[KnownGpu] = &[
    // Blackwell, HGX B200 at 1,000 W (a GB200's GPUs, at 1,200 W, reach ~10 % more). No
    // published Blackwell run is fitted: the generic efficiencies.
    KnownGpu {
        pattern: "B200",
        bf16_tflops: Some(2250.0),
        fp16_tflops: 2250.0,
        fp32_tflops: 80.0,
        memory_gb_per_s: 8000.0,
        link_gb_per_s: 740.0,
        link: LinkKind::Nvlink,
        single_gpu_layout: None,
        efficiency: &OTHER,
        source: "NVIDIA HGX B200 (1,000 W): 2,250 TFLOP/s dense FP16/BF16, 80 FP32, 192 GB HBM3e \
                 at 8 TB/s, NVLink 5 at 1.8 TB/s (https://glennklockwood.com/garden/processors/B200, \
                 https://hmc-tech.com/gpu/nvidia-b200-vs-nvidia-gb200); NCCL bus bandwidth \
                 estimated as twice the H100's 370 GB/s, NVLink 5 being twice NVLink 4",
    },
    KnownGpu {
        pattern: "H200",
        bf16_tflops: Some(989.0),
        fp16_tflops: 989.0,
        fp32_tflops: 66.9,
        memory_gb_per_s: 4800.0,
        link_gb_per_s: 370.0,
        link: LinkKind::Nvlink,
        single_gpu_layout: Some("h200-1x"),
        efficiency: &HOPPER,
        source: "NVIDIA H200 datasheet",
    },
    KnownGpu {
        pattern: "H100 PCIe",
        bf16_tflops: Some(756.0),
        fp16_tflops: 756.0,
        fp32_tflops: 51.2,
        memory_gb_per_s: 2000.0,
        link_gb_per_s: 25.0,
        link: LinkKind::Pcie,
        single_gpu_layout: None,
        efficiency: &HOPPER,
        source: "NVIDIA H100 PCIe datasheet",
    },
    H100_SXM,
    // The H800 and the H20 are Hopper parts cut for export (as the A800 below is an A100): the
    // H800 the H100's die and compute with NVLink cut from 900 to 400 GB/s; the H20 78 of the
    // H100's SMs, 148 TFLOP/s of FP16/BF16, 96 GB of HBM3 at 4.0 TB/s and the full NVLink.
    // Before these rows both matched nothing and got the unknown-GPU guess (A100 rates: the
    // H20 at twice its compute, the H800 at a third of it).
    KnownGpu {
        pattern: "H800",
        link_gb_per_s: 164.0,
        single_gpu_layout: None,
        source: "NVIDIA H800 SXM: H100 SXM datasheet rates, the same die with NVLink 400 GB/s \
                 instead of 900 (https://www.philisun.com/technical-analysis/\
                 nvidia-h800-vs-h100-a-technical-deep-dive-into-politically-defined-ai-chips/); \
                 bus bandwidth estimated as 400/900 of the H100's 370 GB/s",
        ..H100_SXM
    },
    KnownGpu {
        pattern: "H20",
        bf16_tflops: Some(148.0),
        fp16_tflops: 148.0,
        fp32_tflops: 44.0,
        memory_gb_per_s: 4000.0,
        single_gpu_layout: None,
        source: "NVIDIA H20 (96 GB): 148 TFLOP/s dense FP16, 44 FP32, 96 GB HBM3 at 4.0 TB/s, \
                 NVLink 900 GB/s (https://willitrunai.com/es/gpus/h20-96gb, \
                 https://zangshuxian.com/new/674733024499207168); Hopper efficiencies assumed",
        ..H100_SXM
    },
    A100_PCIE,
    A100_SXM,
    // The A800 is the A100's GA100 with NVLink cut from 600 to 400 GB/s (export-control
    // variant, Nov 2022): A100 rates and Ampere efficiencies, two thirds of its NCCL bus
    // bandwidth inside a node. Before this row "NVIDIA A800-SXM4-80GB" matched nothing and got
    // the unknown-GPU guess (issue 36).
    KnownGpu {
        pattern: "A800-PCIE",
        source:
            "NVIDIA A800 PCIe: A100 PCIe datasheet rates, the same GA100 part with a slower NVLink \
                 (https://tweakers.net/nieuws/203182/, https://aiwiki.ai/wiki/nvidia_a800)",
        ..A100_PCIE
    },
    KnownGpu {
        pattern: "A800",
        link_gb_per_s: 133.0,
        source: "NVIDIA A800 SXM: A100 SXM datasheet rates, NVLink 400 GB/s instead of 600 \
                 (https://tweakers.net/nieuws/203182/, https://aiwiki.ai/wiki/nvidia_a800); \
                 bus bandwidth estimated as 400/600 of the A100's 200 GB/s",
        ..A100_SXM
    },
    KnownGpu {
        pattern: "L40S",
        bf16_tflops: Some(362.0),
        fp16_tflops: 362.0,
        fp32_tflops: 91.6,
        memory_gb_per_s: 864.0,
        link_gb_per_s: 12.0,
        link: LinkKind::Pcie,
        single_gpu_layout: None,
        efficiency: &OTHER,
        source: "NVIDIA L40S datasheet",
    },
    // The L40 (the L40S's die at half its 16-bit tensor rate) before the L4, whose name is
    // inside the L40's.
    KnownGpu {
        pattern: "NVIDIA L40",
        bf16_tflops: Some(181.05),
        fp16_tflops: 181.05,
        fp32_tflops: 90.5,
        memory_gb_per_s: 864.0,
        link_gb_per_s: 12.0,
        link: LinkKind::Pcie,
        single_gpu_layout: None,
        efficiency: &OTHER,
        source: "NVIDIA L40 datasheet: 181.05 TFLOP/s dense BF16/FP16 tensor (362.1 with \
                 sparsity), 90.5 FP32, 48 GB GDDR6 at 864 GB/s, PCIe 4.0",
    },
    KnownGpu {
        pattern: "NVIDIA L4",
        bf16_tflops: Some(121.0),
        fp16_tflops: 121.0,
        fp32_tflops: 30.3,
        memory_gb_per_s: 300.0,
        link_gb_per_s: 12.0,
        link: LinkKind::Pcie,
        single_gpu_layout: None,
        efficiency: &OTHER,
        source: "NVIDIA L4 datasheet: 242 TFLOP/s BF16/FP16 tensor with sparsity (121 dense), \
                 30.3 FP32, 24 GB GDDR6 at 300 GB/s, PCIe 4.0, 72 W",
    },
    KnownGpu {
        pattern: "RTX 4090",
        bf16_tflops: Some(165.2),
        fp16_tflops: 165.2,
        fp32_tflops: 82.6,
        memory_gb_per_s: 1008.0,
        link_gb_per_s: 12.0,
        link: LinkKind::Pcie,
        single_gpu_layout: Some("rtx4090-1x"),
        efficiency: &OTHER,
        source: "NVIDIA Ada Lovelace architecture whitepaper",
    },
    KnownGpu {
        // "NVIDIA A40"; the prefix keeps the "RTX A4000" out.
        pattern: "NVIDIA A40",
        bf16_tflops: Some(149.7),
        fp16_tflops: 149.7,
        fp32_tflops: 37.4,
        memory_gb_per_s: 696.0,
        link_gb_per_s: 12.0,
        link: LinkKind::Pcie,
        single_gpu_layout: None,
        efficiency: &AMPERE,
        source: "NVIDIA A40 (GA102): 149.7 TFLOP/s dense FP16/BF16 tensor with FP32 accumulate, \
                 37.4 FP32, 48 GB GDDR6 at 696 GB/s, PCIe 4.0 \
                 (https://hmc-tech.com/gpu/nvidia-a100-vs-nvidia-a40, \
                 http://www.relationship-nepal.org/900-2g133-0000-000.html); Ampere efficiencies \
                 as the A10's",
    },
    KnownGpu {
        pattern: "A10",
        bf16_tflops: Some(125.0),
        fp16_tflops: 125.0,
        fp32_tflops: 31.2,
        memory_gb_per_s: 600.0,
        link_gb_per_s: 12.0,
        link: LinkKind::Pcie,
        single_gpu_layout: None,
        efficiency: &AMPERE,
        source: "NVIDIA A10 datasheet",
    },
    // The V100 parts other than the SXM2/SXM3 module, most specific names first: NVML calls
    // them "Tesla V100-SXM3-32GB-H", "Tesla V100S-PCIE-32GB" and "Tesla V100-PCIE-16GB".
    KnownGpu {
        pattern: "V100-SXM3-32GB-H",
        fp16_tflops: 131.25,
        source: "NVIDIA DGX-2H: the DGX-2 with its V100s' power limit raised to 450 W, 2.1 \
                 PFLOP/s over 16 GPUs against the DGX-2's 2.0 \
                 (https://www.tomshardware.com/news/nvidia-worlds-largest-gpu-dgx-2h,38089.html); \
                 FP32 not stated: the SXM figure",
        single_gpu_layout: None,
        ..V100_SXM
    },
    KnownGpu {
        pattern: "V100S",
        fp16_tflops: 130.0,
        fp32_tflops: 16.4,
        memory_gb_per_s: 1134.0,
        link_gb_per_s: 10.0,
        link: LinkKind::Pcie,
        single_gpu_layout: None,
        source: "NVIDIA V100 datasheet (volta-v100-datasheet-update-us-1165301-r5): V100S PCIe, \
                 130 TFLOP/s tensor, 16.4 FP32, 1,134 GB/s, PCIe 3.0",
        ..V100_SXM
    },
    KnownGpu {
        pattern: "V100-PCIE",
        fp16_tflops: 112.0,
        fp32_tflops: 14.0,
        link_gb_per_s: 10.0,
        link: LinkKind::Pcie,
        single_gpu_layout: None,
        source: "NVIDIA V100 datasheet (volta-v100-datasheet-update-us-1165301-r5): V100 PCIe at \
                 250 W, 112 TFLOP/s tensor, 14 FP32, 900 GB/s, PCIe 3.0",
        ..V100_SXM
    },
    V100_SXM,
    KnownGpu {
        pattern: "TITAN RTX",
        bf16_tflops: None,
        fp16_tflops: 130.0,
        fp32_tflops: 16.3,
        memory_gb_per_s: 672.0,
        link_gb_per_s: 10.0,
        link: LinkKind::Pcie,
        single_gpu_layout: None,
        efficiency: &VOLTA_TURING,
        source: "NVIDIA TITAN RTX specifications",
    },
    // Two common GPUs that got the unknown-GPU guess (A100 rates, 4–5× theirs) until 2026-11-27.
    KnownGpu {
        pattern: "RTX 3090",
        bf16_tflops: Some(71.0),
        fp16_tflops: 71.0,
        fp32_tflops: 35.6,
        memory_gb_per_s: 936.0,
        link_gb_per_s: 12.0,
        link: LinkKind::Pcie,
        single_gpu_layout: None,
        efficiency: &OTHER,
        source: "NVIDIA Ampere GA102 GPU architecture whitepaper v2.0, appendix A (GeForce RTX \
                 3090): 71 TFLOP/s dense FP16/BF16 tensor with FP32 accumulate, 35.6 FP32, \
                 936 GB/s (https://docslib.org/doc/759549/nvidia-ampere-ga102-gpu-architecture-whitepaper)",
    },
    KnownGpu {
        // "Tesla T4" as NVML names it; the space keeps names with "t4" inside a word out.
        pattern: " T4",
        bf16_tflops: None,
        fp16_tflops: 65.0,
        fp32_tflops: 8.1,
        memory_gb_per_s: 320.0,
        link_gb_per_s: 10.0,
        link: LinkKind::Pcie,
        single_gpu_layout: None,
        efficiency: &VOLTA_TURING,
        source: "NVIDIA T4 (Turing TU104): 65 TFLOP/s FP16 tensor, 8.1 FP32, 16 GB GDDR6 at \
                 320 GB/s, PCIe 3.0 (https://sysrqmts.com/en/gpus/nvidia/tesla/t4, \
                 https://www.tomshardware.co.uk/nvidia-tesla-t4-turing-gpu,news-59152.html)",
    },
];

pub fn lookup(name: &str) -> Option<&'static KnownGpu> {
    let lower = name.to_lowercase();
    KNOWN_GPUS
        .iter()
        .find(|g| lower.contains(&g.pattern.to_lowercase()))
}

/// A GPU architecture by CUDA compute capability, and the known row a GPU of it whose name
/// the table lacks is priced as: the row's generation (kernels, efficiencies) is the
/// architecture's; its rates are a stand-in, said so in every figure's source.
#[derive(Debug, PartialEq)]
pub struct Architecture {
    pub name: &'static str,
    pub compute_capability: (u32, u32),
    /// The pattern of the stand-in row in [`KNOWN_GPUS`].
    pub stand_in: &'static str,
}

/// Tensor-core architectures. Not listed, so priced as the unknown-GPU guess: Pascal and older
/// (no tensor cores), Jetson parts, and Blackwell beyond the B200 (10.3, 12.x) until a row can
/// stand in for them. The stand-ins of Volta and GA100 are their PCIe cards: an unnamed part of
/// those generations is most likely one (a TITAN V, an A30), so no NVLink is assumed.
pub const ARCHITECTURES: &[Architecture] = &[
    arch("Volta", (7, 0), "V100-PCIE"),
    arch("Turing", (7, 5), " T4"),
    arch("Ampere (GA100)", (8, 0), "A100-PCIE"),
    arch("Ampere (GA10x)", (8, 6), "NVIDIA A40"),
    arch("Ada Lovelace", (8, 9), "RTX 4090"),
    arch("Hopper", (9, 0), "H100"),
    arch("Blackwell (B200)", (10, 0), "B200"),
];

const fn arch(
    name: &'static str,
    compute_capability: (u32, u32),
    stand_in: &'static str,
) -> Architecture {
    Architecture {
        name,
        compute_capability,
        stand_in,
    }
}

/// `"8.9"` → `(8, 9)`.
pub fn parse_compute_capability(text: &str) -> Option<(u32, u32)> {
    let (major, minor) = text.trim().split_once('.')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// The architecture of a compute capability, and its stand-in row.
pub fn architecture(capability: (u32, u32)) -> Option<(&'static Architecture, &'static KnownGpu)> {
    let a = ARCHITECTURES
        .iter()
        .find(|a| a.compute_capability == capability)?;
    let row = KNOWN_GPUS.iter().find(|g| g.pattern == a.stand_in)?;
    Some((a, row))
}

/// The known row a layout's GPU is priced by: its name's, else its compute capability's
/// stand-in, else none (generic efficiencies).
pub fn row_of(device: &DeviceSpec) -> Option<&'static KnownGpu> {
    lookup(&device.model).or_else(|| {
        let cc = parse_compute_capability(device.compute_capability.as_deref()?)?;
        architecture(cc).map(|(_, row)| row)
    })
}

/// How a figure [`local_layout`] could only guess begins its source.
const GUESS: &str = "guess: ";

/// Whether a device's rates are [`local_layout`]'s guesses (a GPU the table does not name),
/// as their sources say.
pub fn rates_guessed(device: &DeviceSpec) -> bool {
    let r = &device.dense_tflops;
    [&r.bf16, &r.fp16, &r.tf32, &r.fp32]
        .into_iter()
        .flatten()
        .any(|f| f.source.starts_with(GUESS))
}

/// A one-node layout for `count` local GPUs named `name` with `memory_bytes` each and the
/// compute capability NVML reports. A GPU the table does not name gets its architecture's
/// stand-in rates (A100 ones where the capability is unknown too), marked as a guess in every
/// source ([`rates_guessed`]).
pub fn local_layout(
    name: &str,
    count: u32,
    memory_bytes: u64,
    compute_capability: Option<(u32, u32)>,
) -> Layout {
    let known = lookup(name);
    let stand_in = compute_capability.and_then(architecture);
    let g = known.or(stand_in.map(|(_, row)| row)).unwrap_or(&A100_SXM);
    let src = |what: &str| match (known, stand_in) {
        (Some(_), _) => format!("{}: {what}", g.source),
        (None, Some((arch, row))) => format!(
            "{GUESS}{name} is not in the known-GPU table; compute capability {}.{} ({}): the \
             {} row's figures used for {what}",
            arch.compute_capability.0,
            arch.compute_capability.1,
            arch.name,
            row.pattern.trim()
        ),
        (None, None) => {
            format!("{GUESS}{name} is not in the known-GPU table; A100 figures used for {what}")
        }
    };
    let fig = |value: f64, what: &str| Figure {
        value,
        source: src(what),
    };
    let rates = if known.is_some() {
        "datasheet rates"
    } else {
        "guessed rates (not in the known-GPU table)"
    };
    Layout {
        version: LAYOUT_FORMAT_VERSION,
        name: format!("local-{count}x-{}", name.to_lowercase().replace(' ', "-")),
        description: format!("{count} local {name} found through NVML, with {rates}"),
        nodes: 1,
        gpus_per_node: count.max(1),
        device: DeviceSpec {
            kind: DeviceKind::Gpu,
            model: name.to_string(),
            memory_gib: Figure {
                value: memory_bytes as f64 / (1u64 << 30) as f64,
                source: "NVML: total memory of GPU 0".into(),
            },
            dense_tflops: Rates {
                bf16: g.bf16_tflops.map(|v| fig(v, "dense BF16")),
                fp16: Some(fig(g.fp16_tflops, "dense FP16")),
                tf32: None,
                fp32: Some(fig(g.fp32_tflops, "FP32")),
            },
            memory_bandwidth_gb_per_s: fig(g.memory_gb_per_s, "memory bandwidth"),
            efficiency: Default::default(),
            compute_capability: compute_capability.map(|(major, minor)| format!("{major}.{minor}")),
        },
        runtime_overhead_gib: Figure {
            value: 1.5,
            source: "estimate: CUDA context + NCCL buffers + allocator slack".into(),
        },
        intra_node: LinkSpec {
            kind: g.link,
            bus_bandwidth_gb_per_s: fig(g.link_gb_per_s, "typical NCCL bus bandwidth"),
            latency_us: Figure {
                value: 10.0,
                source: "estimate".into(),
            },
            nics_per_node: None,
        },
        inter_node: None,
        gradient_reduce_dtype: None,
        // The host is not known from NVML: no offload until a layout says what it has.
        host: None,
        calibration: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::validate_layout;

    #[test]
    fn each_shipped_one_gpu_layout_is_of_its_gpu() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../layouts");
        let mut shipped = 0;
        for g in KNOWN_GPUS {
            let Some(stem) = g.single_gpu_layout else {
                continue;
            };
            let layout = crate::cluster::read_layout(&dir.join(format!("{stem}.json")))
                .unwrap_or_else(|e| panic!("{stem}: {e}"));
            assert_eq!(layout.world_size(), 1, "{stem} has one GPU");
            assert_eq!(
                lookup(&layout.device.model).map(|k| k.pattern),
                Some(g.pattern),
                "{stem}'s GPU is the {} row's",
                g.pattern
            );
            shipped += 1;
        }
        assert!(
            shipped >= 4,
            "the H200, H100, RTX 4090 and V100 ship layouts"
        );
    }

    #[test]
    fn nvml_names_map_to_datasheet_rates() {
        assert_eq!(
            lookup("NVIDIA H100 80GB HBM3").map(|g| g.memory_gb_per_s),
            Some(3350.0)
        );
        assert_eq!(
            lookup("NVIDIA H100 PCIe").map(|g| g.memory_gb_per_s),
            Some(2000.0)
        );
        assert_eq!(
            lookup("NVIDIA A100-SXM4-80GB").map(|g| g.link_gb_per_s),
            Some(200.0)
        );
        assert_eq!(
            lookup("NVIDIA GeForce RTX 4090").map(|g| g.bf16_tflops),
            Some(Some(165.2))
        );
        assert!(lookup("Matrox G200").is_none());
    }

    /// A T4 is a Turing device (no FlashAttention-2, no bf16), an RTX 3090 a GA102 with a
    /// quarter of the A100's tensor rate, an A40 one with half of it and a B200 seven times it,
    /// not the unknown-GPU guess.
    #[test]
    fn a_t4_an_rtx_3090_an_a40_and_a_b200_get_their_own_rates() {
        let t4 = lookup("Tesla T4").expect("T4 known");
        assert_eq!(t4.efficiency.name, "Volta/Turing");
        assert!(!t4.efficiency.flash_attention);
        assert_eq!((t4.bf16_tflops, t4.fp16_tflops), (None, 65.0));
        let rtx = lookup("NVIDIA GeForce RTX 3090").expect("RTX 3090 known");
        assert_eq!(rtx.bf16_tflops, Some(71.0));
        assert!(lookup("NVIDIA GeForce RTX 4070 Ti").is_none());
        // An A40 is a GA102 datacenter part at half the A100's tensor rate; an RTX A4000 is
        // not an A40.
        // A B200 is a Blackwell part at 2.25 PFLOP/s, not the A100 guess at a seventh of it.
        let b200 = lookup("NVIDIA B200").expect("B200 known");
        assert_eq!(
            (b200.bf16_tflops, b200.memory_gb_per_s),
            (Some(2250.0), 8000.0)
        );
        let a40 = lookup("NVIDIA A40").expect("A40 known");
        assert_eq!((a40.bf16_tflops, a40.memory_gb_per_s), (Some(149.7), 696.0));
        assert!(lookup("NVIDIA RTX A4000").is_none());
    }

    /// The H800 and the H20 are Hopper devices, not unknown ones: the H800 an H100 with a
    /// slower NVLink, the H20 a seventh of its compute with more memory bandwidth. The H20's
    /// row does not catch the H200 (listed first), nor a GH200, which is an H200-class part.
    #[test]
    fn export_variants_of_hopper_are_hopper_class_devices() {
        let h100 = lookup("NVIDIA H100 80GB HBM3").unwrap();
        let h800 = lookup("NVIDIA H800").expect("H800 known");
        assert_eq!(h800.efficiency.name, "Hopper");
        assert_eq!(h800.bf16_tflops, h100.bf16_tflops);
        assert!(h800.link_gb_per_s < h100.link_gb_per_s);
        let h20 = lookup("NVIDIA H20").expect("H20 known");
        assert_eq!(h20.efficiency.name, "Hopper");
        assert_eq!(h20.bf16_tflops, Some(148.0));
        assert_eq!(h20.memory_gb_per_s, 4000.0);
        assert_eq!(h20.link_gb_per_s, h100.link_gb_per_s);
        for h200 in ["NVIDIA H200", "NVIDIA GH200 480GB"] {
            assert_eq!(lookup(h200).map(|g| g.pattern), Some("H200"), "{h200}");
        }
    }

    /// The first matching row wins, so a row listed before another must not take its names:
    /// each row's own pattern finds that row (an "H20" row above the "H200" one, or an "A10"
    /// one above the A100s, would fail here), and builds a valid local layout that does not
    /// guess.
    #[test]
    fn no_row_shadows_a_later_one() {
        for g in KNOWN_GPUS {
            let name = g.pattern;
            assert_eq!(lookup(name).map(|k| k.pattern), Some(g.pattern), "{name}");
            let l = local_layout(name, 8, 80 << 30, None);
            assert!(!rates_guessed(&l.device), "{name}");
            validate_layout(&l).unwrap();
            let src = &l.device.dense_tflops.fp16.as_ref().unwrap().source;
            assert!(!src.starts_with("guess"), "{name}: {src}");
        }
    }

    /// A V100 on a PCIe card is not the SXM2 module: less compute, no NVLink between the
    /// GPUs (a 4 × V100 PCIe box is priced over PCIe, not at NVSwitch's 130 GB/s); a V100S
    /// has faster memory; a DGX-2H's V100 runs at 450 W; an L4 is not an L40, nor an L40 an
    /// L40S.
    #[test]
    fn each_v100_part_and_each_ada_datacenter_part_gets_its_own_row() {
        let sxm = lookup("Tesla V100-SXM2-16GB").unwrap();
        let pcie = lookup("Tesla V100-PCIE-32GB").expect("V100 PCIe known");
        assert_eq!((pcie.fp16_tflops, pcie.link), (112.0, LinkKind::Pcie));
        assert!(pcie.link_gb_per_s < sxm.link_gb_per_s / 10.0);
        let v100s = lookup("Tesla V100S-PCIE-32GB").expect("V100S known");
        assert_eq!((v100s.fp16_tflops, v100s.memory_gb_per_s), (130.0, 1134.0));
        let dgx2h = lookup("Tesla V100-SXM3-32GB-H").expect("DGX-2H part known");
        assert_eq!(dgx2h.fp16_tflops, 131.25);
        assert_eq!(dgx2h.link, LinkKind::Nvlink);
        assert_eq!(
            lookup("Tesla V100-SXM3-32GB").map(|g| g.fp16_tflops),
            Some(125.0)
        );
        for g in [pcie, v100s, dgx2h] {
            assert_eq!(g.efficiency.name, "Volta/Turing", "{}", g.pattern);
        }
        let rates = |name: &str| lookup(name).map(|g| g.bf16_tflops);
        assert_eq!(rates("NVIDIA L4"), Some(Some(121.0)));
        assert_eq!(rates("NVIDIA L40"), Some(Some(181.05)));
        assert_eq!(rates("NVIDIA L40S"), Some(Some(362.0)));
    }

    #[test]
    fn an_a800_is_an_a100_class_device_with_a_slower_nvlink() {
        let a800 = lookup("NVIDIA A800-SXM4-80GB").expect("A800 known");
        let a100 = lookup("NVIDIA A100-SXM4-80GB").unwrap();
        assert_eq!(a800.efficiency.name, "Ampere");
        assert_eq!(a800.bf16_tflops, a100.bf16_tflops);
        assert_eq!(a800.memory_gb_per_s, a100.memory_gb_per_s);
        assert!(a800.link_gb_per_s < a100.link_gb_per_s);
        let pcie = lookup("NVIDIA A800-PCIE-40GB").unwrap();
        assert_eq!(pcie.link, LinkKind::Pcie);
        assert_eq!(pcie.efficiency.name, "Ampere");
        let l = local_layout("NVIDIA A800-SXM4-80GB", 8, 80 << 30, None);
        validate_layout(&l).unwrap();
        let src = &l.device.dense_tflops.bf16.as_ref().unwrap().source;
        assert!(!src.starts_with("guess") && src.contains("A800"), "{src}");
    }

    /// A GPU the table does not name is priced with its architecture's kernels, not generic
    /// ones: a Turing card gets no FlashAttention and Turing's efficiencies, an unknown Hopper
    /// part Hopper's; the figures say they are a guess and which row stands in.
    #[test]
    fn an_unknown_name_is_priced_by_its_compute_capability() {
        let turing = local_layout("Quadro RTX 6000", 4, 24 << 30, Some((7, 5)));
        assert!(rates_guessed(&turing.device));
        validate_layout(&turing).unwrap();
        assert_eq!(turing.device.compute_capability.as_deref(), Some("7.5"));
        let row = row_of(&turing.device).expect("the Turing stand-in");
        assert!(!row.efficiency.flash_attention);
        assert_eq!(row.efficiency.name, "Volta/Turing");
        let src = &turing.device.dense_tflops.fp16.as_ref().unwrap().source;
        assert!(
            src.starts_with("guess") && src.contains("7.5 (Turing)") && src.contains("T4"),
            "{src}"
        );
        // A name no row matches: the capability alone makes it a Hopper device.
        let hopper = local_layout("Hopper Test Part", 1, 94 << 30, Some((9, 0)));
        assert!(lookup("Hopper Test Part").is_none());
        assert_eq!(
            row_of(&hopper.device).map(|g| g.efficiency.name),
            Some("Hopper")
        );
        // No capability, or one without a listed architecture: the A100 guess, generic kernels.
        for cc in [None, Some((6, 0)), Some((12, 0))] {
            let l = local_layout("Mystery GPU 9000", 1, 16 << 30, cc);
            assert!(row_of(&l.device).is_none(), "{cc:?}");
            let src = &l.device.dense_tflops.fp16.as_ref().unwrap().source;
            assert!(src.contains("A100 figures"), "{src}");
        }
        // An unnamed Volta or GA100 part is taken for a PCIe card: no NVLink assumed.
        for cc in [(7, 0), (8, 0)] {
            let l = local_layout("Unnamed Part", 2, 32 << 30, Some(cc));
            assert_eq!(l.intra_node.kind, LinkKind::Pcie, "{cc:?}");
        }
        // A named GPU keeps its own row whatever the capability says.
        let mut l4 = local_layout("NVIDIA L4", 1, 24 << 30, Some((8, 9)));
        assert!(!rates_guessed(&l4.device));
        assert_eq!(row_of(&l4.device).map(|g| g.pattern), Some("NVIDIA L4"));
        // Every architecture's stand-in is a row of the table.
        for a in ARCHITECTURES {
            assert!(architecture(a.compute_capability).is_some(), "{}", a.name);
        }
        // A layout with a malformed capability is refused with the field named.
        l4.device.compute_capability = Some("eight".into());
        let e = validate_layout(&l4).unwrap_err().to_string();
        assert!(e.contains("compute_capability"), "{e}");
    }

    #[test]
    fn local_layouts_are_valid_and_say_when_they_guess() {
        let l = local_layout("NVIDIA H200", 4, 150_754_820_096, Some((9, 0)));
        assert!(!rates_guessed(&l.device));
        validate_layout(&l).unwrap();
        assert_eq!(l.world_size(), 4);
        assert_eq!(l.memory_bytes(), 150_754_820_096 / 1024 * 1024);
        let g = local_layout("Mystery GPU 9000", 2, 16 << 30, None);
        assert!(rates_guessed(&g.device) && g.description.contains("guessed rates"));
        validate_layout(&g).unwrap();
        assert!(g
            .device
            .dense_tflops
            .bf16
            .unwrap()
            .source
            .starts_with("guess"));
    }
}
