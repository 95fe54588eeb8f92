"""Personalization methods, one module each, registered by their `--method` name."""

from peradapt.personalize import apfl as _apfl  # noqa: F401  (registers apfl)
from peradapt.personalize import body_head as _body_head  # noqa: F401  (registers fedper, fedrep, fedbabu)
from peradapt.personalize import ditto as _ditto  # noqa: F401  (registers ditto)
from peradapt.personalize import fedala as _fedala  # noqa: F401  (registers fedala)
from peradapt.personalize import fedavg as _fedavg  # noqa: F401  (registers fedavg, fedavg-ft)
from peradapt.personalize import feddf as _feddf  # noqa: F401  (registers feddf)
from peradapt.personalize import feddyn as _feddyn  # noqa: F401  (registers feddyn)
from peradapt.personalize import fedprox as _fedprox  # noqa: F401  (registers fedprox)
from peradapt.personalize import fedprox_li as _fedprox_li  # noqa: F401  (registers fedprox-li)
from peradapt.personalize import fedrod as _fedrod  # noqa: F401  (registers fedrod)
from peradapt.personalize import mtl as _mtl  # noqa: F401  (registers mtl)
from peradapt.personalize import partial as _partial  # noqa: F401  (fedbn, lg-fedavg, fedalt, fedsim)
from peradapt.personalize import perada as _perada  # noqa: F401  (registers perada, perada-nokd)
from peradapt.personalize import perfedavg as _perfedavg  # noqa: F401  (registers perfedavg)
from peradapt.personalize import pfedbred as _pfedbred  # noqa: F401  (registers pfedbred)
from peradapt.personalize import pfedme as _pfedme  # noqa: F401  (registers pfedme)
from peradapt.personalize import standalone as _standalone  # noqa: F401  (registers standalone)
from peradapt.personalize.base import (
    METHODS,
    ClientUpdate,
    Method,
    MethodContext,
    build_method,
    check_private_method,
    method_class,
)

__all__ = ["METHODS", "ClientUpdate", "Method", "MethodContext", "build_method", "check_private_method", "method_class"]
