"""pFedBreD: a personalized prior mean, from relaxed mirror descent, for the Bregman-Moreau envelope.

Shi et al., "PRIOR: Personalized Prior for Reactivating the Information Overlooked in Federated Learning"
(NeurIPS 2023), Algorithm 1 with the first-order spherical-Gaussian implementation "pFedBreD_ns" of Section 5
(g = g* = ||.||^2 / 2, so D_g*(theta, mu) = ||theta - mu||^2 / 2 and, by Appendix A.7, D mu_i ~= I and
grad^2 g* = I). A sampled client i starts from w_{i,0} <- w^{t-1} and theta_{i,0} <- theta_{i,R}^{(t-1)} (its
theta of the last round it took part in) and, for every minibatch D of `local_epochs` passes (local step r):

    line 7, Eq. (14)   mu_r    <- w_{r-1} - eta_a * grad f_i(w_{r-1}; D)                                  lg
                                  w_{r-1} - eta * (w_{i,R}^{(t-1)} - theta_{r-1})                            meg
                                  w_{r-1} - eta_a * grad f_i(w_{r-1}; D) - eta * (w_{i,R}^{(t-1)} - theta_{r-1})   mh
    line 8, Eq. (2)    theta_r <- argmin_theta f_i(theta; D) + lam/2 ||theta - mu_r||^2    (K gradient steps)
    line 9, Eq. (13)   w_r     <- w_{r-1} - alpha_m * lam * (mu_r - theta_r)

and uploads w_{i,R}. The server sets w^t <- (1 - beta) w^{t-1} + beta * (1/S) sum_i w_{i,R} (line 12, uniform
client weights as the paper's aggregation I). w_{i,R}^{(t-1)} is the client's memory of its own last upload
(Appendix C.1, "memorized"); theta_i and that memory are the client state kept in the store.

Conventions of this implementation:
- `--prior` picks lg (loss gradient, Phi_i = f_i), meg (memorized envelope gradient, Phi_i = F_i) or mh
  (memorized hybrid, Phi_i = f_i + F_i; the paper's main method and the default). The Appendix C.2 variant of mh
  (Eq. 24, a gradient at a look-ahead point) is not implemented.
- eta_a is `--prior-lr` and eta `--prior-eta` (0.01 and 0.05, the paper's Section 6.1 values); alpha_m is
  `--lr`, the inner step size `--personal-lr` (default `--lr`), lam `--lam`, K `--inner-steps`, beta `--beta`;
  `--am` (aggregate momentum, Appendix C.4) sets beta = 2.
- grad f_i(w_{r-1}) is taken on the same minibatch D as the inner problem, in training mode.
- The first time a client is sampled, its theta and its memory are the global model it receives, so the memory
  term of meg / mh starts at zero.
- The whole network trains (`default_scope = "full"`): the paper's models are trained whole, and pFedBreD is
  compared with pFedMe, a full-model baseline in PerAda's Table 1. BatchNorm statistics are handled as in pFedMe.
"""

from __future__ import annotations

import torch

from peradapt.adapters import AdapterState
from peradapt.data import ClientData
from peradapt.errors import ConfigError
from peradapt.federation.seeds import LOCAL, derive_seed
from peradapt.personalize.base import ClientUpdate, MethodContext, register
from peradapt.personalize.pfedme import PFedMe, Tensors, assign, detached

MEMORY_KEY = "memory"  # w_{i,R}^{(t-1)}: the client's last upload
PRIORS = ("lg", "meg", "mh")


@register
class PFedBreD(PFedMe):
    name = "pfedbred"
    summary = "Bregman-Moreau envelope with a personalized prior mean from relaxed mirror descent (Shi et al. 2023)"
    default_scope = "full"
    uses_proximal = True

    def __init__(self, context: MethodContext) -> None:
        super().__init__(context)
        if self.config.prior not in PRIORS:
            raise ConfigError(f"unknown --prior '{self.config.prior}': use {', '.join(PRIORS)}")
        if self.config.prior_lr < 0 or self.config.prior_eta < 0:
            raise ConfigError("--prior-lr and --prior-eta must not be negative")

    def client_update(self, client: ClientData, global_state: AdapterState, seed: int) -> ClientUpdate:
        lam, alpha_m = self.config.lam, self.config.lr
        model = self.trainer.model
        model.load_state(global_state)  # w_{i,0} <- w^{t-1}; running statistics from the global model
        model.train()
        theta = model.trainable_parameters()
        local = detached(theta)
        memory = self.store.get(client.client_id, MEMORY_KEY) or global_state  # w_{i,R}^{(t-1)}
        assign(theta, self.personalized(client.client_id, global_state))  # theta_{i,0} <- theta_{i,R}^{(t-1)}
        losses = []
        for images, labels in self.trainer.minibatches(
            client.train, epochs=self.config.local_epochs, seed=derive_seed(seed, LOCAL)
        ):
            mu = self.prior_mean(local, memory, images, labels)  # line 7
            losses += self.inner_steps(images, labels, anchor=mu)  # line 8
            with torch.no_grad():  # line 9
                for name, parameter in theta.items():
                    local[name].sub_(alpha_m * lam * (mu[name] - parameter))
        update = self._finish(client, local, losses)
        self.store.put(client.client_id, MEMORY_KEY, update.upload)
        return update

    def prior_mean(self, local: Tensors, memory: AdapterState, images: torch.Tensor, labels: torch.Tensor) -> Tensors:
        """mu_r = w_{r-1} - eta * grad Phi_i(w_{r-1}) (Eq. 14), with theta_{r-1} loaded in the model."""
        prior = self.config.prior
        theta = self.trainer.model.trainable_parameters()
        previous = detached(theta)  # theta_{r-1}
        mu = detached(local)
        if prior in ("lg", "mh"):  # - eta_a * grad f_i(w_{r-1})
            assign(theta, local)
            _, grads = self.gradient(images, labels)
            assign(theta, previous)
            for name in mu:
                mu[name].sub_(self.config.prior_lr * grads[name])
        if prior in ("meg", "mh"):  # - eta * (w_{i,R}^{(t-1)} - theta_{r-1})
            for name in mu:
                mu[name].sub_(self.config.prior_eta * (memory[name] - previous[name]))
        return mu
