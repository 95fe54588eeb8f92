"""Personalization methods, one module each, registered by their `--method` name."""

from peradapt.methods import apfl as _apfl  # noqa: F401  (registers apfl)
from peradapt.methods import body_head as _body_head  # noqa: F401  (registers fedper, fedrep, fedbabu)
from peradapt.methods import ditto as _ditto  # noqa: F401  (registers ditto)
from peradapt.methods import fedala as _fedala  # noqa: F401  (registers fedala)
from peradapt.methods import fedavg as _fedavg  # noqa: F401  (registers fedavg, fedavg-ft)
from peradapt.methods import feddf as _feddf  # noqa: F401  (registers feddf)
from peradapt.methods import feddyn as _feddyn  # noqa: F401  (registers feddyn)
from peradapt.methods import fedprox as _fedprox  # noqa: F401  (registers fedprox)
from peradapt.methods import fedprox_li as _fedprox_li  # noqa: F401  (registers fedprox-li)
from peradapt.methods import fedrod as _fedrod  # noqa: F401  (registers fedrod)
from peradapt.methods import mtl as _mtl  # noqa: F401  (registers mtl)
from peradapt.methods import partial as _partial  # noqa: F401  (fedbn, lg-fedavg, fedalt, fedsim)
from peradapt.methods import perada as _perada  # noqa: F401  (registers perada, perada-nokd)
from peradapt.methods import perfedavg as _perfedavg  # noqa: F401  (registers perfedavg)
from peradapt.methods import pfedbred as _pfedbred  # noqa: F401  (registers pfedbred)
from peradapt.methods import pfedme as _pfedme  # noqa: F401  (registers pfedme)
from peradapt.methods import plugins as _plugins  # noqa: F401  (finds methods from outside peradapt)
from peradapt.methods import scaffold as _scaffold  # noqa: F401  (registers scaffold)
from peradapt.methods import standalone as _standalone  # noqa: F401  (registers standalone)
from peradapt.methods.base import (
    ClientUpdate,
    LocalSGDMethod,
    Method,
    MethodContext,
    build_method,
    check_private_method,
    method_class,
    register,
)
from peradapt.registry import METHODS  # the registry, re-exported for code that registers and looks up methods

__all__ = [
    "METHODS",
    "ClientUpdate",
    "LocalSGDMethod",
    "Method",
    "MethodContext",
    "build_method",
    "check_private_method",
    "method_class",
    "register",
]
