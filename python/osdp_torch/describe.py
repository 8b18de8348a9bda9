"""``describe``: the model description osdp-tui plans (model.json, family ``torch``) made from a
live ``nn.Module`` by running one forward on fake (or meta) tensors.

One op per module that owns parameters directly, named by its module path; one more per module
without parameters of its own that computes outside its children (an attention core, an
activation, the residual adds of a block), and ``loss`` for ``loss_fn``. Each op's figures are
what its forward did for the example batch, per sample: FLOPs (``FlopCounterMode``'s formulas),
bytes saved for backward (``saved_tensors_hooks``; a tensor saved twice counted once, at the
first op that saves it; parameters not counted) and output bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

MODEL_FORMAT_VERSION = 1

_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


class DescribeError(ValueError):
    """A module or example that cannot be described."""


class _Op:
    def __init__(self, op_id: str, name: str) -> None:
        self.id = op_id
        self.name = name
        self.params: List[Dict[str, Any]] = []
        self.inputs: List[str] = []
        self.flops = 0
        self.saved = 0
        self.output_bytes = 0
        self.output_shape: Optional[List[int]] = None


def _tensors(x: Any) -> List[torch.Tensor]:
    """The tensors in a (nested) output: tensors, tuples, lists, dicts, ModelOutputs."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    return []


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor ``t`` is a view of (meta and fake views do not always share a storage)."""
    while t._base is not None:
        t = t._base
    return t


def _storage_key(t: torch.Tensor) -> int:
    return _root(t).untyped_storage()._cdata


def _signature(module: nn.Module) -> tuple:
    """What makes two blocks alike: their module classes and parameter names, shapes, dtypes."""
    return (
        tuple((n, type(m).__name__) for n, m in module.named_modules()),
        tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters()),
    )


def _blocks(model: nn.Module) -> List[str]:
    """Module paths of the blocks: the largest run (by parameters) of alike children of one
    ``ModuleList`` or ``Sequential``; none when no container holds two alike children."""
    best: List[str] = []
    best_params = 0
    for path, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        groups: Dict[tuple, List[str]] = OrderedDict()
        for name, child in m.named_children():
            groups.setdefault(_signature(child), []).append(f"{path}.{name}" if path else name)
        for members in groups.values():
            if len(members) < 2:
                continue
            params = sum(p.numel() for q in members for p in model.get_submodule(q).parameters())
            if params > best_params:
                best, best_params = members, params
    return best


class _Counter(FlopCounterMode):
    """FlopCounterMode whose counts go to the op running when the kernel runs."""

    def __init__(self, charge: Callable[[int], None]) -> None:
        super().__init__(display=False)
        self._charge = charge
        self.flop_registry = dict(self.flop_registry)
        # PyTorch's CPU fused attention has no formula of its own: the same as its CUDA kernel.
        cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
        if cpu is not None:
            self.flop_registry[cpu] = lambda q, k, v, *a, out_val=None, **kw: sdpa_flop_count(
                q.shape, k.shape, v.shape
            )

    def _count_flops(self, func_packet, out, args, kwargs):
        if func_packet in self.flop_registry:
            self._charge(int(self.flop_registry[func_packet](*args, **kwargs, out_val=out)))
        else:
            self._charge(_elementwise_flops(func_packet, out, args, kwargs or {}))
        return out


def _elementwise_flops(func_packet, out, args, kwargs) -> int:
    """FLOPs of the kernels FlopCounterMode has no formula for (it counts matmuls and
    convolutions only), which small models spend a fair share on: one per output element of a
    pointwise op, one per input element of a sum or mean, and for the fused kernels the
    arithmetic of their formula per element. Copies and views do no arithmetic."""
    outs = [t for t in _tensors(out) if t.is_floating_point()]
    if not outs or func_packet in _NO_ARITHMETIC:
        return 0
    per = _PER_ELEMENT.get(func_packet)
    if per is not None:
        if func_packet is _aten.gelu and kwargs.get("approximate", "none") != "tanh" and "tanh" not in args:
            per = 5
        return per * outs[0].numel()
    if func_packet in _REDUCTIONS:
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        return first.numel() if first is not None else 0
    pointwise = _POINTWISE.get(func_packet)
    if pointwise is None:
        pointwise = _POINTWISE[func_packet] = any(
            torch.Tag.pointwise in getattr(func_packet, o).tags for o in func_packet.overloads()
        )
    return outs[0].numel() if pointwise else 0


_POINTWISE: Dict[Any, bool] = {}


_aten = torch.ops.aten
_NO_ARITHMETIC = {_aten.clone, _aten.copy_, _aten._to_copy, _aten.copy, _aten.lift_fresh}
_REDUCTIONS = {_aten.sum, _aten.mean}
# Per element: layer norm = mean (1) + variance (subtract, square, sum: 3) + scale (1) +
# affine (2); (log-)softmax = subtract the max, exp, sum, normalise (4); GELU, tanh form = cube,
# 2 multiplies, add, tanh, add, 2 multiplies (8), erf form 5 (set above); SiLU = x·sigmoid(x)
# with sigmoid as negate, exp, add, divide (5).
_PER_ELEMENT = {
    _aten.native_layer_norm: 7,
    _aten._softmax: 4,
    _aten._log_softmax: 4,
    _aten.gelu: 8,
    _aten.silu: 5,
}


class _FusedAttention(torch.overrides.TorchFunctionMode):
    """``scaled_dot_product_attention`` as its fused kernel runs it on a GPU, which fake and meta
    tensors do not reach (they take the math path, materialising the probabilities): its FLOPs,
    and what it keeps for backward, queries, keys, values, output and an fp32 log-sum-exp per
    row and head."""

    def __init__(self, charge_flops: Callable[[int], None], save: Callable[[torch.Tensor], Any], charge_saved: Callable[[int], None]) -> None:
        super().__init__()
        self._flops, self._save, self._saved = charge_flops, save, charge_saved

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        out = q.new_empty((*q.shape[:-1], v.shape[-1])).requires_grad_(grad)
        # Scores and the weighted sum: 2·q·k and 2·probabilities·v FLOPs per query row and key.
        rows, keys = q[..., 0].numel(), k.shape[-2]
        self._flops(2 * rows * keys * (q.shape[-1] + v.shape[-1]))
        if grad:
            for t in (q, k, v, out):
                self._save(t)
            self._saved(q[..., 0].numel() * 4)
        return out


def describe(
    model: nn.Module,
    example_inputs: Any,
    *,
    name: str,
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
) -> Dict[str, Any]:
    """The description of ``model`` (a dict; ``json.dump`` it to a model.json).

    ``example_inputs``: one batch as the forward takes it: a tensor, a tuple of positional
    arguments, or a dict of keyword arguments; its first tensor's first dimension is the batch
    (figures are per sample), and when that tensor is integer with two dimensions (token ids)
    the second is the sequence length. ``loss_fn(output)`` gives the loss; without it the
    output's ``loss`` (Hugging Face) or the output itself is the loss.

    Nothing of real size is allocated: the forward runs on fake tensors (``FakeTensorMode``),
    on the meta device for a model built there; the module is neither changed nor moved. It
    runs in training mode (what training keeps for backward: dropout masks included), and each
    submodule's mode is restored afterwards. A Hugging Face model should have
    ``config.use_cache = False``, as training has: with a cache, transformers copies every
    block's keys and values, and the description counts the copies.
    """
    if not name or not name.strip():
        raise DescribeError("describe needs a name for the model")
    if isinstance(example_inputs, dict):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    else:
        args, kwargs = (example_inputs,), {}
    first = next(iter(_tensors([args, kwargs])), None)
    if first is None or first.dim() == 0:
        raise DescribeError("example_inputs hold no batched tensor (its first dimension is the batch)")
    batch = int(first.shape[0])
    seq_len = int(first.shape[1]) if first.dim() >= 2 and not first.is_floating_point() else 1

    params = list(model.parameters())
    if not params:
        raise DescribeError("the model has no parameters: there is nothing to plan")
    floating = [p.dtype for p in params if p.dtype in _DTYPES]
    if not floating:
        raise DescribeError(f"the model's parameters are {params[0].dtype}; describe reads float32, bfloat16, float16")
    on_meta = params[0].is_meta

    # Ops of the modules that own parameters, named by path; tied parameters at their first owner.
    paths = {m: p for p, m in model.named_modules(remove_duplicate=False)}
    ops: "OrderedDict[str, _Op]" = OrderedDict()
    order: List[_Op] = []  # in forward order
    owner_of: Dict[int, str] = {}
    param_storage = set()
    for path, m in model.named_modules(remove_duplicate=False):
        own = [(n, p) for n, p in m._parameters.items() if p is not None]
        if not own or path in ops:
            continue
        op = _Op(path or "root", path)
        for n, p in own:
            if p.dtype not in _DTYPES:
                raise DescribeError(f"parameter {path}.{n} is {p.dtype}; describe reads float32, bfloat16, float16")
            spec = {"name": n, "shape": list(p.shape), "dtype": _DTYPES[p.dtype]}
            if id(p) in owner_of:
                spec["tied_to"] = owner_of[id(p)]
            else:
                owner_of[id(p)] = f"{op.id}.{n}"
            op.params.append(spec)
            param_storage.add(_storage_key(p))
        ops[path] = op

    stack: List[str] = []
    producer: Dict[int, str] = {}
    keep: List[Any] = []  # outputs and saved tensors stay alive, so ids and storages stay unique
    saved_seen = set()

    def op_for(path: str) -> _Op:
        op = ops.get(path)
        if op is None:
            op = ops[path] = _Op(path or "root", path)
        if op not in order:
            op.inputs = [order[-1].id] if order else []
            order.append(op)
        return op

    def current() -> _Op:
        return op_for(stack[-1] if stack else "")

    def charge_flops(n: int) -> None:
        if n:
            current().flops += n

    def pre(module, a, kw):
        path = paths[module]
        stack.append(path)
        if path in ops and ops[path].params:
            op = op_for(path)
            found = [producer[id(t)] for t in _tensors([a, kw]) if id(t) in producer]
            if found:
                op.inputs = list(OrderedDict.fromkeys(found))

    def post(module, a, kw, out):
        path = stack.pop()
        op = ops.get(path)
        if op is not None and op in order:
            ts = _tensors(out)
            op.output_bytes = sum(t.numel() * t.element_size() for t in ts)
            if ts:
                op.output_shape = list(ts[0].shape[1:]) or [1]
            for t in ts:
                producer[id(t)] = op.id
            keep.append(out)

    def pack(t: torch.Tensor):
        if isinstance(t, nn.Parameter):
            return t
        try:
            key = _storage_key(t)
            size = _root(t).untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            key, size = id(t), t.numel() * t.element_size()
        if key in param_storage or key in saved_seen:
            return t
        saved_seen.add(key)
        keep.append(t)
        current().saved += size
        return t

    handles = []
    for m in paths:
        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True, always_call=True))
    # Fake tensors, also over a meta model: code that asks for values where it could skip them
    # (transformers' packed-sequence check on position ids) skips them for fake tensors only.
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    to = lambda t: (  # noqa: E731
        mode.from_tensor(t.to("meta") if on_meta else t) if isinstance(t, torch.Tensor) else t
    )
    for p in params:  # the fakes the forward meets in the parameters' place, kept alive
        keep.append(mode.from_tensor(p))  # (so no other storage takes their address)
        param_storage.add(_storage_key(keep[-1]))
    args = tuple(to(a) for a in args)
    kwargs = {k: to(v) for k, v in kwargs.items()}
    modes = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        def charge_saved(n: int) -> None:
            current().saved += n

        fused = _FusedAttention(charge_flops, pack, charge_saved)
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with mode, torch.enable_grad(), _Counter(charge_flops), hooks, fused:
            out = model(*args, **kwargs)
            keep.append(out)
            stack.append("loss")
            if loss_fn is not None:
                loss = loss_fn(out)
            elif getattr(out, "loss", None) is not None:
                loss = out.loss
            elif isinstance(out, dict) and out.get("loss") is not None:
                loss = out["loss"]
            else:
                loss = out
            stack.pop()
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise DescribeError(
                    "the forward gives no loss (a one-element tensor): pass loss_fn=lambda output: ..."
                )
    finally:
        for h in handles:
            h.remove()
        for m, training in modes:
            m.training = training
    if "loss" in ops and ops["loss"] in order:
        ops["loss"].output_bytes = loss.element_size()
        ops["loss"].output_shape = [1]

    for op in ops.values():  # modules that own parameters but did not run
        if op not in order and op.params:
            op.inputs = [order[-1].id] if order else []
            order.append(op)

    blocks = _blocks(model)
    block_of = lambda path: next(  # noqa: E731
        (i for i, b in enumerate(blocks) if path == b or path.startswith(b + ".")), None
    )

    def per_sample(x: int) -> int:
        return (x + batch - 1) // batch

    dtype = _DTYPES[floating[0]]
    out_ops = []
    for op in order:
        out_ops.append(
            {
                "id": op.id,
                "name": op.name,
                "kind": "module",
                "block": block_of(op.name) if op.name not in ("", "loss") else None,
                "inputs": op.inputs,
                "params": op.params,
                "output_shape": op.output_shape or [1],
                "fwd_flops_per_sample": per_sample(op.flops),
                "saved_bytes_per_sample": per_sample(op.saved),
                "output_bytes_per_sample": per_sample(op.output_bytes),
            }
        )
    return {
        "version": MODEL_FORMAT_VERSION,
        "name": name,
        "family": "torch",
        "source": f"osdp_torch.describe of {type(model).__module__}.{type(model).__qualname__}",
        "config": {
            # Read by the planner: items per sample, blocks, the activations' dtype.
            "seq_len": seq_len,
            "layers": max(len(blocks), 1),
            "dtype": dtype,
            # A transformer's; neutral for a described module (the planner does not read them).
            "vocab_size": 1,
            "max_positions": seq_len,
            "hidden": 1,
            "embed_dim": 1,
            "heads": 1,
            "kv_heads": 1,
            "head_dim": 1,
            "ffn_hidden": 1,
            "norm": "layer_norm",
            "norm_eps": 1e-5,
            "norm_position": "pre",
            "final_norm": False,
            "activation": "gelu",
            "gated_mlp": False,
            "tied_embeddings": any("tied_to" in p for op in order for p in op.params),
            "bias": {"qkv": False, "attn_out": False, "mlp": False, "norm": False, "lm_head": False},
            "positional": "learned",
            "position_offset": 0,
            "type_vocab_size": 0,
            "causal": False,
            "dropout": 0.0,
            "attention_dropout": 0.0,
            "attention": "eager",
        },
        "ops": out_ops,
    }
