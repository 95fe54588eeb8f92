"""peradapt: personalized federated learning with adapters on frozen pretrained backbones.

The Python API (`peradapt.train`, `evaluate`, `export`, `personalize_new_client`, `pretrain`, `compare`, `report`; see
`peradapt.api`) does what the commands do. Importing peradapt registers the residual adapter with PEFT (so exported
adapters load with a plain `peft.PeftModel.from_pretrained`), the narrow ResNets (`resnet18_w16`, ...) with timm, and
the built-in methods (so that a config knows their settings, `peradapt.config.METHODS`). A method of one's own
subclasses `Method` or `LocalSGDMethod`, or a built-in method (`method_class("fedavg")`), and runs as
`--method module:Class` (docs/ADDING_A_METHOD.md).
"""

# ruff: noqa: E402  (the first line below runs before the imports of torch, timm and PEFT that follow it)
from peradapt.errors import quiet_interrupts_while_starting

quiet_interrupts_while_starting()

from typing import Any

from peradapt import backbones as _backbones  # noqa: F401  (registers narrow ResNets with timm)
from peradapt import methods as _methods  # noqa: F401  (registers the built-in methods and their settings)
from peradapt.adapters import AdaptedModel, AdapterState, inject_adapters
from peradapt.config import TrainConfig
from peradapt.errors import PeradaptError
from peradapt.methods import LocalSGDMethod, Method, method_class, register

__version__ = "0.1.0"

_API = (
    "compare",
    "evaluate",
    "export",
    "personalize_new_client",
    "pretrain",
    "push_to_hub",
    "report",
    "train",
    "training_config",
)

__all__ = [
    "AdaptedModel",
    "AdapterState",
    "LocalSGDMethod",
    "Method",
    "PeradaptError",
    "TrainConfig",
    "__version__",
    "inject_adapters",
    "method_class",
    "register",
    *_API,
]


def __getattr__(name: str) -> Any:
    """The API's functions, imported when first used: the command line starts without the training stack."""
    if name in _API:
        from peradapt import api

        return getattr(api, name)
    raise AttributeError(f"module 'peradapt' has no attribute '{name}'")
