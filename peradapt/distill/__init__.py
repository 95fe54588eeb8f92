"""Ensemble knowledge distillation of the global adapter on unlabeled data."""

from peradapt.distill.kd import Distiller, ensemble_logits, kd_loss, multilabel_kd_loss

__all__ = ["Distiller", "ensemble_logits", "kd_loss", "multilabel_kd_loss"]
