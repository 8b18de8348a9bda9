"""``apply_plan``: an osdp-tui FSDP2 export applied to a live ``nn.Module`` with
``torch.distributed.fsdp.fully_shard``."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

EXPORT_VERSION = 1


class PlanError(ValueError):
    """An export that does not fit the model, or that FSDP2 cannot run."""


def load_export(export: Union[str, os.PathLike, Dict[str, Any]]) -> Dict[str, Any]:
    """The export as a dict, checked to be an FSDP2 export this package reads."""
    if isinstance(export, dict):
        data, where = export, "export"
    else:
        where = os.fspath(export)
        try:
            with open(where) as f:
                data = json.load(f)
        except OSError as e:
            raise PlanError(f"{where}: cannot read the export: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise PlanError(f"{where}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None
    if data.get("target") != "fsdp2":
        raise PlanError(
            f"{where}: not an FSDP2 export (target {data.get('target')!r}); write one with "
            "`osdp-tui export MODEL.json --plan PLAN.json --layout L --to fsdp2 -o EXPORT.json`"
        )
    if data.get("version") != EXPORT_VERSION:
        raise PlanError(f"{where}: export version {data.get('version')!r}, this osdp_torch reads {EXPORT_VERSION}")
    for m in data.get("modules", []):
        if m.get("sharding") not in ("dp", "zero2", "zero3", "hsdp"):
            raise PlanError(
                f"{where}: module {m.get('path')!r} is {m.get('sharding')!r}, which FSDP2 cannot run "
                "(plan with --target fsdp2)"
            )
    return data


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _owned_numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters(recurse=False))


def _check_model(model: nn.Module, data: Dict[str, Any]) -> Dict[str, nn.Module]:
    """Each planned module path, resolved; refuses a model the export was not made for."""
    name = data.get("model", "?")
    count = sum(p.numel() for p in model.parameters())  # shared parameters once
    found: Dict[str, nn.Module] = {}
    paths = [m["path"] for m in data["modules"]] + [t for m in data["modules"] for t in m.get("tied", [])]
    for path in paths:
        try:
            found[path] = model.get_submodule(path)
        except AttributeError:
            raise PlanError(
                f"the export for model {name!r} plans module {path!r}, which this model lacks "
                f"(export fingerprint {data.get('model_fingerprint')})"
            ) from None
    for m in data["modules"]:
        have = _owned_numel(found[m["path"]])
        if have != m["numel"]:
            raise PlanError(
                f"module {m['path']!r} has {have} parameters, the export for model {name!r} "
                f"(fingerprint {data.get('model_fingerprint')}) says {m['numel']}: "
                "the export was made for another model"
            )
    if count != data["param_count"]:
        raise PlanError(
            f"this model has {count} parameters, the export for model {name!r} "
            f"(fingerprint {data.get('model_fingerprint')}) {data['param_count']}: "
            "the export was made for another model"
        )
    return found


def apply_plan(
    model: nn.Module,
    export: Union[str, os.PathLike, Dict[str, Any]],
    *,
    mesh: Optional[Any] = None,
) -> nn.Module:
    """Shard ``model`` in place as the export says and return it.

    Per planned module, innermost first: ``fully_shard`` with ``reshard_after_forward=True``
    for zero3 and hsdp, ``False`` for zero2 and dp; dp on a ``(world, 1)`` mesh (replicated),
    hsdp on ``(nodes, ranks_per_node)``; ``CPUOffloadPolicy`` for ``+offload-param``; the
    precision's ``MixedPrecisionPolicy``. Recomputed blocks are wrapped in
    ``checkpoint_wrapper`` first, then the root is sharded. ``mesh``: a 1-D mesh of all ranks
    (by default one from the initialised default process group).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    data = load_export(export)
    found = _check_model(model, data)
    if not dist.is_initialized():
        raise PlanError("apply_plan needs an initialised default process group (dist.init_process_group)")
    world = dist.get_world_size()
    if world != data["world_size"]:
        raise PlanError(
            f"the export was planned for {data['world_size']} ranks, this process group has {world}"
        )
    if mesh is not None:
        device_type = mesh.device_type
    else:
        device_type = "cpu" if dist.get_backend() == "gloo" else "cuda"
    meshes: Dict[tuple, Any] = {}

    def mesh_of(shape: List[int]):
        shape = tuple(shape)
        if len(shape) == 1 and mesh is not None:
            return mesh
        if shape not in meshes:
            names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
            meshes[shape] = init_device_mesh(device_type, shape, mesh_dim_names=names)
        return meshes[shape]

    prec = data["precision"]
    param_dtype = _dtype(prec["param_dtype"])
    reduce_dtype = _dtype(prec["reduce_dtype"])
    mp = MixedPrecisionPolicy(
        param_dtype=None if param_dtype == torch.float32 else param_dtype,
        reduce_dtype=None if reduce_dtype == param_dtype else reduce_dtype,
    )

    # Recomputed blocks first: the wrapper replaces the block in its parent, so module
    # objects (resolved above) stay valid while their paths gain a prefix.
    if data.get("checkpoint"):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for path in data["checkpoint"]:
            try:
                block = model.get_submodule(path)
            except AttributeError:
                raise PlanError(f"the export recomputes block {path!r}, which this model lacks") from None
            parent_path, _, leaf = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            setattr(parent, leaf, checkpoint_wrapper(block))

    order = sorted(data["modules"], key=lambda m: -m["path"].count("."))
    for m in order:
        modules = [found[m["path"]]] + [found[t] for t in m.get("tied", [])]
        offload = CPUOffloadPolicy(pin_memory=device_type != "cpu") if m["offload"] else OffloadPolicy()
        fully_shard(
            modules if len(modules) > 1 else modules[0],
            mesh=mesh_of(m["mesh"]),
            reshard_after_forward=m["reshard_after_forward"],
            mp_policy=mp,
            offload_policy=offload,
        )
    fully_shard(model, mesh=mesh_of([world]), mp_policy=mp)
    return model


def local_param_bytes(model: nn.Module) -> int:
    """Bytes of this rank's local shards of every parameter (whole for unsharded ones)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total
