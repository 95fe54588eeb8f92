"""Personalization methods, one module each, registered by their `--method` name."""

from peradapt.personalize import perada as _perada  # noqa: F401  (registers perada, perada-nokd)
from peradapt.personalize.base import (
    METHODS,
    ClientUpdate,
    Method,
    MethodContext,
    build_method,
    method_class,
)

__all__ = ["METHODS", "ClientUpdate", "Method", "MethodContext", "build_method", "method_class"]
