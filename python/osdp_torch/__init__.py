"""Plan any PyTorch model with osdp-tui and run the plan in your own training loop.

``describe(model, example_inputs, name="m")`` gives the model description ``osdp-tui plan``
reads (``json.dump`` it to a model.json); ``apply_plan(model, "export.json")`` shards
``model`` in place with FSDP2 as the export (``osdp-tui export MODEL.json --plan PLAN.json
--layout L --to fsdp2 -o export.json``) says.
"""

from .apply import PlanError, apply_plan, load_export
from .describe import DescribeError, describe

__all__ = ["DescribeError", "PlanError", "apply_plan", "describe", "load_export"]
