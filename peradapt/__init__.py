"""peradapt: personalized federated learning with adapters on frozen pretrained backbones.

Importing peradapt registers the residual adapter with PEFT (so exported adapters load with a plain
`peft.PeftModel.from_pretrained`) and the narrow ResNets (`resnet18_w16`, ...) with timm.
"""

from peradapt import backbones as _backbones  # noqa: F401  (registers narrow ResNets with timm)
from peradapt.adapters import AdaptedModel, AdapterState, inject_adapters
from peradapt.config import TrainConfig
from peradapt.errors import PeradaptError

__version__ = "0.1.0"

__all__ = ["AdaptedModel", "AdapterState", "PeradaptError", "TrainConfig", "__version__", "inject_adapters"]
