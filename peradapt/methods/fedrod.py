"""FedRoD: a generic model trained on a class-balanced risk, and a personal head on top of it.

H.-Y. Chen and W.-L. Chao, "On Bridging Generic and Personalized Federated Learning for Image Classification"
(ICLR 2022), Sec. 4 and Algorithm 1 (FedRoD with a linear personalized head). The model is a feature extractor
f(x; theta), a generic head h_G(z; psi) shared by all clients and a personal head h_P(z; phi_m) of client m;
client m's personalized prediction is h_G(z; psi) + h_P(z; phi_m), z = f(x; theta). The second head is the
engine's (`Method.second_head`, `AdaptedModel.add_personal_head`).

A sampled client m starts from the global (theta, psi) and its own phi_m and, for every minibatch (x, y) of E
local epochs (--local-epochs, or --local-steps minibatches), takes one step on each loss with the same forward pass:

    generic model, balanced risk (Balanced Softmax, Ren et al. 2020, with gamma = 1):
        L_BR(theta, psi) = CE(h_G(z) + log n_m, y),  n_m,c the client's training samples of class c
        (theta, psi) <- (theta, psi) - eta * grad L_BR
    personal head, empirical risk on the personalized logits, theta and psi fixed:
        L_ER(phi_m) = CE(sg[h_G(z)] + h_P(sg[z]; phi_m), y)
        phi_m <- phi_m - eta_p * grad L_ER

sg[.] stops gradients: no gradient of L_ER reaches theta or psi, none of L_BR reaches phi_m, so one backward pass
of L_BR + L_ER is both steps (as PFLlib's clientrod.py takes them with two optimizers on one forward pass). The
client uploads (theta, psi); the server takes their mean weighted by the clients' sample counts n_m over the
sampled clients (`--aggregation uniform`: the plain mean); phi_m never leaves client m. Client m is evaluated
and exported with the global (theta, psi) and its phi_m. eta = --lr, eta_p = --personal-lr (default --lr).
The local epochs are one SGD job with two parameter groups, phi_m at eta_p and the rest at eta, descending
L_BR + L_ER (`LocalTrainer.descend`); as that is not the task loss, clients train one after another even with
--concurrent-clients.

- phi_m starts at zero (--personal-head-init zero), as the engine's personal head: the global model, whose
  personal head stays zero, predicts with h_G alone, so its rows in the report are FedRoD's generic model
  ("G-FL"). `generic`: a copy of the initial h_G, as PFLlib's client deep-copies the model's head.
- A new client (`peradapt personalize`) learns phi_m on top of the fixed global model: --personal-epochs of L_ER.
- The hypernetwork variant (FedRoD (hyper), phi_m generated from the class distribution) is not implemented.
- Multi-hot labels (CheXpert) have no class prior n_m for the Balanced Softmax: refused.
- The whole network trains (scope `full`), as in the paper, unless --scope says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from peradapt.adapters import AdapterState
from peradapt.compute.trainer import Objective
from peradapt.data import ClientData, ImageSet
from peradapt.errors import ConfigError
from peradapt.methods.base import ClientUpdate, MethodContext, register
from peradapt.methods.partial import PartialModel, PartialModelSettings
from peradapt.seeds import LOCAL, derive_seed
from peradapt.settings import setting

PERSONAL_HEAD_INITS = ("zero", "generic")


@dataclass
class FedRoDSettings(PartialModelSettings):
    personal_head_init: str = setting(
        "zero",
        help="FedRoD: each client's personal head at start: zero (the global model is then the generic one) or "
        "generic (a copy of the initial generic head, as PFLlib).",
        choices=PERSONAL_HEAD_INITS,
    )


@register
class FedRoD(PartialModel):
    name = "fedrod"
    summary = "FedRoD: Balanced-Softmax generic model, personal linear head on top (Chen & Chao 2022, Algorithm 1)"
    second_head = True
    default_part = "personal head"
    settings_class = FedRoDSettings
    settings: FedRoDSettings

    def __init__(self, context: MethodContext) -> None:
        if any(client.train.labels is not None and client.train.labels.dim() == 2 for client in context.clients):
            raise ConfigError(
                "--method fedrod balances its softmax by each client's class counts, which multi-label data has "
                "not: use another --method"
            )
        super().__init__(context)  # checks the settings: an unknown --personal-head-init is refused there
        if self.settings.personal_head_init == "generic":
            heads = self.trainer.model.personal_head_keys
            self.initial_personal = {key: context.initial[generic].clone() for key, generic in heads.items()}

    def personal_part_keys(self) -> list[str]:
        return list(self.trainer.model.personal_head_keys)

    def client_update(self, client: ClientData, global_state: AdapterState, seed: int) -> ClientUpdate:
        """E epochs of the two steps per minibatch (module docstring) from (theta, psi, phi_m); phi_m kept, (theta,
        psi) uploaded."""
        config = self.config
        job = self.part_job(
            self.personalized(client.client_id, global_state),
            client.train,
            self.personal + self.shared,
            epochs=config.local_epochs,
            steps=config.local_steps,
            seed=derive_seed(seed, LOCAL),
        )
        state, metrics = self.trainer.descend(job, self.risks(client.train))
        return self.kept_and_sent(client, state, metrics)

    def client_samples_bound(self, client: ClientData) -> int:
        return self.local_samples(client)

    def risks(self, data: ImageSet) -> Objective:
        """L_BR and L_ER of a minibatch (module docstring), logged as local_loss and personal_loss."""
        model, inputs = self.trainer.model, self.trainer.inputs
        assert data.labels is not None and model.personal_head is not None
        counts = torch.bincount(data.labels, minlength=model.personal_head.out_features)
        log_prior = counts.to(model.device, torch.float32).log()  # log n_m,c; -inf for absent classes: never seen

        def terms(images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            with inputs.autocast():
                generic, personal = model.split_logits(images, detach_features=True)
                balanced = F.cross_entropy(generic.float() + log_prior, labels)  # L_BR: Balanced Softmax
                empirical = F.cross_entropy(generic.detach() + personal, labels)  # L_ER of the personalized model
            return balanced, empirical  # disjoint gradients: L_BR's reach (theta, psi), L_ER's only phi_m

        return Objective(terms, ("local_loss", "personal_loss"))
