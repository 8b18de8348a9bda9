#!/usr/bin/env python3
"""Count the memory passes PyTorch's eager ops make over a tensor, forward and backward.

The cost model prices transformers' eager code by passes through memory (an element read or
written counts 1 × its dtype's bytes). This script runs the code in question on CPU under a
TorchDispatchMode, sums the bytes of every ATen op's tensor inputs and outputs of the watched
size, and prints them per element, forward and backward, under the names of the constants in
crates/osdp-core/src/cost/graph.rs and precision.rs that take them: `python3
scripts/eager-passes.py [--json]` (`describe::eager_pass_counts_are_what_the_script_counts`
compares the two).

CUDA autocast is emulated by the casts it inserts (softmax, pow and log_softmax are on its
fp32 list; matmuls on its fp16 list), since CPU autocast keeps different lists.
"""
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NO_TRAFFIC = {"aten.view", "aten._unsafe_view", "aten.t", "aten.transpose", "aten.expand",
              "aten.detach", "aten.slice", "aten.alias", "aten.unsqueeze", "aten.select",
              "aten.as_strided", "aten.permute", "aten._reshape_alias", "aten.reshape",
              "aten.view_as_complex", "aten.view_as_real", "aten.squeeze"}


def real_numel(t):
    """A tensor's elements counted as real numbers (a complex one holds two a slot)."""
    return t.numel() * (2 if t.is_complex() else 1)


class Bytes(TorchDispatchMode):
    """Sums the bytes of every ATen op's tensors of the watched size: `numel` elements, or
    (`halves_and_doubles`) half or twice that, which rotary embeddings make (rotate_half's
    halves, the complex form's pairs, a 2 x 2 rotation's products)."""

    def __init__(self, numel, halves_and_doubles=False):
        super().__init__()
        self.numel, self.bytes, self.ops = numel, 0, []
        self.sizes = {numel, numel // 2, 2 * numel} if halves_and_doubles else {numel}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if name in NO_TRAFFIC:
            return out
        ts = [a for a in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(a, torch.Tensor)]
        b = sum(t.element_size() * t.numel() for t in ts if real_numel(t) in self.sizes)
        if b:
            self.bytes += b
            self.ops.append(name)
        return out


def passes(fn, shape, dtype, elem=2, halves_and_doubles=False):
    """(forward, backward) bytes per element of `shape` over `elem`: passes at `elem` bytes."""
    x = torch.randn(*shape, dtype=dtype, requires_grad=True)
    n = x.numel()
    with Bytes(n, halves_and_doubles) as f:
        y = fn(x)
    g = torch.ones_like(y)
    with Bytes(n, halves_and_doubles) as b:
        y.backward(g)
    return f.bytes / n / elem, b.bytes / n / elem, f.ops, b.ops


def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_new_autocast(x):
    # CUDA autocast runs pow in fp32; type promotion carries fp32 to the end, and the next
    # linear (on autocast's half list) casts the result back.
    y = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x.float(), 3.0))))
    return y.to(x.dtype)


def gelu_fast(x):
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def gelu_fused(x):
    return torch.nn.functional.gelu(x, approximate="tanh")


def attention(autocast):
    """GPT-2's eager attention between its two matmuls (transformers' GPT2Attention._attn):
    scale, causal mask by `where`, softmax (and under autocast the casts around it). Stand-in
    multiplies take the matmuls' places: the first stands for the write of the scores, the
    last for the read of the probabilities; each also reads (forward) what the matmul would
    not, one pass each, taken off by `attention_passes`. Dropout is left out: on a CPU it is
    three kernels where CUDA's is one (the cost model counts CUDA's by hand)."""
    s = 64
    mask = torch.tril(torch.ones(s, s, dtype=torch.bool))

    def run(scores):
        w = scores * 1.0
        w = w / 8.0
        w = torch.where(mask, w, torch.tensor(-1e4, dtype=w.dtype))
        w = torch.softmax(w.float() if autocast else w, dim=-1)
        if autocast:
            w = w.to(torch.bfloat16)
        return w * 1.0

    return run, (4, s, s)


def attention_passes(autocast):
    fn, shape = attention(autocast)
    fw, bw, _, _ = passes(fn, shape, torch.bfloat16)
    return fw - 2.0, bw


def hf_trainer_step(clip=True, unscale=True):
    """Bytes per parameter of what the Hugging Face Trainer (transformers 4.12, no DeepSpeed)
    runs once a step on fp32 parameters: the AMP grad scaler's unscale and overflow check, the
    gradient clipping (a norm per tensor, then a scale), transformers' own `AdamW` (a Python
    loop of PyTorch ops per tensor: the moments, the denominator, the update, decoupled weight
    decay) and zeroing the gradients."""
    n = 1 << 16
    p = torch.randn(n)
    g, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    with Bytes(n) as b:
        if unscale:
            found = torch.zeros(1)
            torch._amp_foreach_non_finite_check_and_unscale_([g], found, torch.ones(1))
        if clip:
            norm = torch.linalg.vector_norm(g)
            g.mul_(1.0 / (norm + 1e-6))
        m.mul_(0.9).add_(g, alpha=0.1)
        v.mul_(0.999).addcmul_(g, g, value=0.001)
        denom = v.sqrt().add_(1e-8)
        p.addcdiv_(m, denom, value=-1e-4)
        # (no weight-decay kernel: the Trainer's default weight_decay is 0.0)
        g.zero_()
    return b.bytes / n, len(b.ops)


def llama_rms_norm():
    """transformers' LlamaRMSNorm (the same in Mistral, Qwen2 and the other Llama-style models):
    upcast to fp32, pow, mean, rsqrt, multiply, cast back, scale by the weight."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(256).to(torch.bfloat16)
    return lambda x: norm(x)


def llama_rotary(x):
    """transformers' apply_rotary_pos_emb on queries (keys the same, counted per tensor: the
    keys it rotates beside them here are one head, a size the count does not watch): `q * cos
    + rotate_half(q) * sin`, rotate_half a negation and a concatenation of the two halves."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    b, h, s, d = x.shape
    cos = torch.randn(b, s, d, dtype=x.dtype)
    sin = torch.randn(b, s, d, dtype=x.dtype)
    q, _ = apply_rotary_pos_emb(x, torch.randn(b, 1, s, d, dtype=x.dtype), cos, sin)
    return q


def complex_rotary(x):
    """Rotary embeddings in the complex form of Meta's Llama reference code, as torchtitan's
    `apply_rotary_emb` (torchtitan/models/llama/model.py at 1ea476e, April 2024) applies them
    to queries (keys the same): upcast to fp32, viewed as complex pairs, multiplied by the
    complex frequencies, viewed back as real and cast back. `x` is (batch, seq, heads, dim)."""
    b, s, h, d = x.shape
    angles = torch.randn(s, d // 2)
    freqs = torch.polar(torch.ones_like(angles), angles).view(1, s, 1, d // 2)
    xc = torch.view_as_complex(x.float().reshape(b, s, h, d // 2, 2))
    return torch.view_as_real(xc * freqs).flatten(3).type_as(x)


def pair_matrix_rotary(x):
    """Rotary embeddings as IBM's foundation-model-stack applies them
    (`RotaryEmbedding.adjusted_qk` in fms/modules/positions.py at 6440fee, March 2024): the
    fp32 pairs multiplied by a 2 x 2 rotation per pair (a product twice the tensor's size),
    summed over the rotation's inner dimension, cast back. `x` is (batch, seq, heads, dim)."""
    b, s, h, d = x.shape
    rot = torch.randn(b, s, d // 2, 2, 2)
    pairs = x.float().view(b, s, h, d // 2, 2)
    return rot[:, :, None].mul(pairs.unsqueeze(-2)).sum(5).flatten(3).type_as(x)


def halves_rotary(x):
    """Rotary embeddings on the two halves of the head in the input's dtype, as KempnerForge's
    `apply_rope` (kempnerforge/model/position.py at 9f3f03a, 2026) makes them: `cat([x1 * cos -
    x2 * sin, x2 * cos + x1 * sin])`, the tables cast to bf16 first. `x` is (batch, heads, seq,
    dim)."""
    b, h, s, d = x.shape
    cos = torch.randn(s, d // 2).to(x.dtype).view(1, 1, s, d // 2)
    sin = torch.randn(s, d // 2).to(x.dtype).view(1, 1, s, d // 2)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def figures():
    """Every figure the cost model takes from this script, by the name of its constant."""
    half = torch.bfloat16
    out = {}
    for name, fn, shape in [
        ("EAGER_GELU_NEW_PASSES", gelu_new, (64, 256)),
        ("EAGER_GELU_NEW_AUTOCAST_PASSES", gelu_new_autocast, (64, 256)),
        ("EAGER_GELU_FAST_PASSES", gelu_fast, (64, 256)),
        ("EAGER_RMS_NORM_PASSES", llama_rms_norm(), (64, 256)),
        ("fused tanh GELU (for reference)", gelu_fused, (64, 256)),
    ]:
        fw, bw, _, _ = passes(fn, shape, half)
        out[name] = [fw, bw]
    # Six heads: no frequency table is then half, equal to or twice the rotated tensor.
    for name, fn, shape in [
        ("EAGER_ROTARY_PASSES", llama_rotary, (2, 6, 64, 32)),
        ("EAGER_COMPLEX_ROTARY_PASSES", complex_rotary, (2, 64, 6, 32)),
        ("EAGER_PAIR_MATRIX_ROTARY_PASSES", pair_matrix_rotary, (2, 64, 6, 32)),
        ("EAGER_HALVES_ROTARY_PASSES", halves_rotary, (2, 6, 64, 32)),
    ]:
        fw, bw, _, _ = passes(fn, shape, half, halves_and_doubles=True)
        out[name] = [fw, bw]
    out["EAGER_ATTENTION_PASSES"] = list(attention_passes(False))
    out["EAGER_ATTENTION_AUTOCAST_PASSES"] = list(attention_passes(True))
    step, kernels = hf_trainer_step()
    out["HF_TRAINER_STEP_BYTES_PER_PARAM"] = step
    out["HF Trainer step kernels per tensor"] = kernels
    return out


def main():
    import json
    import sys

    out = figures()
    if "--json" in sys.argv[1:]:
        print(json.dumps(out, indent=1))
        return
    for name, value in out.items():
        if isinstance(value, list):
            print(f"{name:40s} forward {value[0]:5.1f}  backward {value[1]:5.1f}  (2-byte passes)")
        else:
            print(f"{name:40s} {value}")


if __name__ == "__main__":
    main()
