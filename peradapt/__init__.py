"""peradapt: personalized federated learning with adapters on frozen pretrained backbones.

The Python API (`peradapt.train`, `evaluate`, `export`, `personalize_new_client`, `pretrain`, `compare`, `report`,
`info`; see `peradapt.api`) does what the commands do. After `import peradapt`, exported adapters load with a plain
`peft.PeftModel.from_pretrained` and the narrow ResNets (`resnet18_w16`, ...) with `timm.create_model`: the residual
adapter is registered with PEFT, and those backbones with timm, when PEFT and timm are imported (before or after
peradapt; wrapt's post-import hooks). The built-in methods are registered when the method registry is first read,
so that a config knows their settings (`peradapt.registry.METHODS`). A method of one's own subclasses `Method` or
`LocalSGDMethod`, or a built-in method (`method_class("fedavg")`), and runs as `--method module:Class`
(docs/ADDING_A_METHOD.md).

What the package exports from the layers below is imported when first used, so that `import peradapt` (which the
command line does first) starts without torch, PEFT and timm: `peradapt --help` needs none of them.
"""

# ruff: noqa: E402  (the first line below runs before any import that may take seconds)
from peradapt.errors import quiet_interrupts_while_starting

quiet_interrupts_while_starting()

from types import ModuleType
from typing import TYPE_CHECKING

import wrapt

from peradapt.config import TrainConfig
from peradapt.errors import PeradaptError
from peradapt.imports import imported_when_used

if TYPE_CHECKING:
    from peradapt.adapters import AdaptedModel, AdapterState, inject_adapters
    from peradapt.methods import LocalSGDMethod, Method, method_class, register

__version__ = "0.1.0"

_API = (
    "compare",
    "evaluate",
    "export",
    "info",
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


# Where each of the names above that is imported when first used is defined.
_LAZY = {
    **dict.fromkeys(_API, "api"),
    **dict.fromkeys(("AdaptedModel", "AdapterState", "inject_adapters"), "adapters"),
    **dict.fromkeys(("LocalSGDMethod", "Method", "method_class", "register"), "methods"),
}


# The API's functions, the adapters' and the methods' names: the command line starts without the training stack.
__getattr__, __dir__ = imported_when_used(__name__, _LAZY, __all__)


def _register_adapters(peft: ModuleType) -> None:
    """Every LoraConfig of peradapt's adapters registers their layers with PEFT (`peradapt.adapters.residual`): a
    plain `PeftModel.from_pretrained` rebuilds them."""
    from peradapt.adapters import vit  # noqa: F401  (it imports residual; each adds its layer)


def _register_backbones(timm: ModuleType) -> None:
    """timm builds the narrow ResNets (`resnet18_w16`, ...) and tiny ViTs (`vit_tiny_p4_32`) by name."""
    from peradapt import backbones  # noqa: F401  (registers them with timm)


# Now if PEFT and timm are imported already, else right after their import, by whatever imports them (peradapt's own
# modules included).
wrapt.register_post_import_hook(_register_adapters, "peft")
wrapt.register_post_import_hook(_register_backbones, "timm")
