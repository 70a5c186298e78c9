"""LazyTrain: train LLMs larger than the accelerator by streaming layers and planning every activation boundary.

Public names are imported lazily so that `import lazytrain` stays cheap (no torch/transformers import
for the planner CLI) and one component's import error cannot break the others.
"""

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "ModelSpec": "lazytrain.costmodel.model",
    "HardwareSpec": "lazytrain.costmodel.hardware",
    "Workload": "lazytrain.costmodel.workload",
    "CostModel": "lazytrain.costmodel.cost",
    "Plan": "lazytrain.plan.plan",
    "Executor": "lazytrain.runtime.executor",
    "EmulatedDevice": "lazytrain.runtime.device",
    "CudaDevice": "lazytrain.runtime.device",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lazytrain' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
