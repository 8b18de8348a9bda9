"""Run an osdp-tui plan in your own PyTorch training loop.

``apply_plan(model, "export.json")`` shards ``model`` in place with FSDP2 as the export
(``osdp-tui export MODEL.json --plan PLAN.json --layout L --to fsdp2 -o export.json``) says.
"""

from .apply import PlanError, apply_plan, load_export

__all__ = ["PlanError", "apply_plan", "load_export"]
