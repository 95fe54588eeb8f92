"""pFedBreD: a personalized prior mean, from relaxed mirror descent, for the Bregman-Moreau envelope.

Shi et al., "PRIOR: Personalized Prior for Reactivating the Information Overlooked in Federated Learning"
(NeurIPS 2023), Algorithm 1 with the first-order spherical-Gaussian implementation "pFedBreD_ns" of Section 5
(g = g* = ||.||^2 / 2, so D_g*(theta, mu) = ||theta - mu||^2 / 2 and, by Appendix A.7, D mu_i ~= I and
grad^2 g* = I). Every round all N clients train (line 4, "for i = 1...N"): client i starts from
w_{i,0} <- w^{t-1} and theta_{i,0} <- theta_{i,R}^{(t-1)} (its theta of the last round it trained) and, for each
of R local steps r on a fresh minibatch D:

    line 7, Eq. (14)   mu_r    <- w_{r-1} - eta_a * grad f_i(w_{r-1}; D)                                  lg
                                  w_{r-1} - eta * (w_{i,R}^{(t-1)} - theta_{r-1})                            meg
                                  w_{r-1} - eta_a * grad f_i(w_{r-1}; D) - eta * (w_{i,R}^{(t-1)} - theta_{r-1})   mh
    line 8, Eq. (2)    theta_r <- argmin_theta f_i(theta; D) + lam/2 ||theta - mu_r||^2    (K gradient steps)
    line 9, Eq. (13)   w_r     <- w_{r-1} - alpha_m * lam * (mu_r - theta_r)

The server then sets w^t <- (1 - beta) w^{t-1} + beta * (1/S) sum_{i in S^t} w_{i,R} over a uniform sample S^t
(line 12 with the aggregation I of Section 6.1, "uniform sampling"); the other clients' uploads are discarded, but
each client keeps its theta and its memory w_{i,R}^{(t-1)} of its own last w_{i,R} (Appendix C.1, "memorized").

`--prior mh-code` is mh as the authors' code (BDeMo/pFedBreD_public, pFedBreD_ns_mh) computes it for the paper's mh
numbers. Local step r reads two minibatches D, D' and

    w_{r-1} <- w_{r-1} - eta_a * grad f_i(w_{r-1} - eta_a * grad f_i(w_{r-1}; D); D')    (w itself takes this step)
    mu_r     = w_{r-1} - eta * (w_{i,R}^{(t-1)} - theta_{r-1})

which is Eq. (24) of Appendix C.2 with eta~_alpha = eta_a / eta and eta~ = eta_a, "used in practice"; then line 8
runs on D' starting from that w_{r-1} (not from theta_{r-1}), and line 9 moves on from that w_{r-1}.

Conventions of this implementation:
- `--prior` picks lg (loss gradient, Phi_i = f_i), meg (memorized envelope gradient, Phi_i = F_i), mh
  (memorized hybrid, Phi_i = f_i + F_i; the paper's main method and the default) or mh-code (above).
- R is `--local-steps` (the paper's R = 20) or, by default, one local step per minibatch of `--local-epochs`
  passes; mh-code reads two minibatches per local step, so 2R minibatches (2E passes).
- eta_a is `--prior-lr` and eta `--prior-eta` (0.01 and 0.05, the paper's Section 6.1 values); alpha_m is
  `--lr`, the inner step size `--personal-lr` (default `--lr`), lam `--lam`, K `--inner-steps`, beta `--beta`;
  `--am` (aggregate momentum, Appendix C.4) sets beta = 2. `--train-clients sampled` trains only the sample;
  `--aggregation samples` weighs the server mean by training-set size (the authors' code).
- grad f_i(w_{r-1}) is taken in training mode, on the same minibatch D as the inner problem (Eq. 14 priors).
- The first time a client trains, its theta and its memory are the global model it receives, so the memory
  term of meg / mh starts at zero.
- The whole network trains (`default_scope = "full"`): the paper's models are trained whole, and pFedBreD is
  compared with pFedMe, a full-model baseline in PerAda's Table 1. BatchNorm statistics are handled as in pFedMe.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from peradapt.adapters import AdapterState
from peradapt.data import ClientData
from peradapt.methods.base import ClientUpdate, register
from peradapt.methods.pfedme import Batch, PFedMe, PFedMeSettings, Tensors, assign, detached
from peradapt.settings import Search, setting

MEMORY_KEY = "memory"  # w_{i,R}^{(t-1)}: the client's last upload
CODE_PRIOR = "mh-code"  # mh as the authors' code computes it (Eq. 24, look-ahead gradient on a second minibatch)
PRIORS = ("lg", "meg", "mh", CODE_PRIOR)


@dataclass
class PFedBreDSettings(PFedMeSettings):
    prior: str = setting(
        "mh",
        help="pFedBreD prior mean: lg, meg, mh (Eq. 14) or mh-code (the authors' code's mh: the Eq. 24 look-ahead "
        "gradient on a second minibatch, w stepped by it, the inner problem started there).",
        choices=PRIORS,
        symbol="μ",
    )
    prior_lr: float = setting(
        0.01, help="pFedBreD meta-step η_α on the loss gradient (lg, mh, mh-code).", minimum=0.0, symbol="η_α"
    )
    prior_eta: float = setting(
        0.05,
        help="pFedBreD meta-step η on the memorized envelope gradient (meg, mh).",
        minimum=0.0,
        symbol="η",
        search=Search.uniform(0.0, 1.0),  # the range of η in Appendix C.6 (Figure 5); Section 6.1 runs 0.05
    )


@register
class PFedBreD(PFedMe):
    name = "pfedbred"
    summary = "Bregman-Moreau envelope with a personalized prior mean from relaxed mirror descent (Shi et al. 2023)"
    default_scope = "full"
    uses_proximal = True
    # Section 6.1: "λ is chosen from 15.0 to 60.0" (in pFedMe's and PerAda's range of it here, w would barely move)
    tunes: ClassVar[Mapping[str, Search | None]] = {"lam": Search.uniform(15.0, 60.0), "personal_lr": None}
    settings_class = PFedBreDSettings
    settings: PFedBreDSettings

    def client_update(self, client: ClientData, global_state: AdapterState, seed: int) -> ClientUpdate:
        lam, alpha_m = self.config.lam, self.config.lr
        model = self.trainer.model
        model.load_state(global_state)  # w_{i,0} <- w^{t-1}; running statistics from the global model
        model.train()
        theta = model.trainable_parameters()
        local = detached(theta)
        for model_trained in (theta, local):  # theta_i and w_i
            self.trainer.count_trained(model_trained.values())
        memory = self.store.get(client.client_id, MEMORY_KEY) or global_state  # w_{i,R}^{(t-1)}
        assign(theta, self.personalized(client.client_id, global_state))  # theta_{i,0} <- theta_{i,R}^{(t-1)}
        per_step = 2 if self.settings.prior == CODE_PRIOR else 1
        stream = self.minibatches(client, seed, per_step)
        losses = []
        for batches in zip(*[stream] * per_step, strict=True):  # local step r: consecutive minibatches
            mu = self.prior_mean(local, memory, batches)  # line 7
            images, labels = batches[-1]
            losses += self.inner_steps(images, labels, anchor=mu)  # line 8
            with torch.no_grad():  # line 9
                for name, parameter in theta.items():
                    local[name].sub_(alpha_m * lam * (mu[name] - parameter))
        update = self._finish(client, local, losses)
        self.store.put(client.client_id, MEMORY_KEY, update.upload)
        return update

    def client_samples_bound(self, client: ClientData) -> int:
        """At most K + 1 gradients on each minibatch: the prior's (none for meg; mh-code's two on the step's two
        minibatches), then K inner steps on the last."""
        per_step = 2 if self.settings.prior == CODE_PRIOR else 1
        return (self.settings.inner_steps + 1) * self.sgd_samples(client, *self.minibatch_count(per_step))

    def prior_mean(self, local: Tensors, memory: AdapterState, batches: Sequence[Batch]) -> Tensors:
        """mu_r = w_{r-1} - eta * grad Phi_i(w_{r-1}) (Eq. 14) from w_{r-1} = `local`, with theta_{r-1} loaded in
        the model, which holds theta_{r-1} again afterwards; mh-code: `look_ahead_prior_mean`."""
        if self.settings.prior == CODE_PRIOR:
            return self.look_ahead_prior_mean(local, memory, *batches)
        prior, (images, labels) = self.settings.prior, batches[0]
        theta = self.trainer.model.trainable_parameters()
        previous = detached(theta)  # theta_{r-1}
        mu = detached(local)
        if prior in ("lg", "mh"):  # - eta_a * grad f_i(w_{r-1})
            assign(theta, local)
            _, grads = self.gradient(images, labels)
            assign(theta, previous)
            for name in mu:
                mu[name].sub_(self.settings.prior_lr * grads[name])
        if prior in ("meg", "mh"):  # - eta * (w_{i,R}^{(t-1)} - theta_{r-1})
            for name in mu:
                mu[name].sub_(self.settings.prior_eta * (memory[name] - previous[name]))
        return mu

    def look_ahead_prior_mean(self, local: Tensors, memory: AdapterState, first: Batch, second: Batch) -> Tensors:
        """The authors' code's mh: w_{r-1} = `local` steps (in place) by -eta_a * grad f_i at the look-ahead point
        w_{r-1} - eta_a * grad f_i(w_{r-1}; first), taken on `second`; mu_r = w_{r-1} - eta * (w_{i,R}^{(t-1)} -
        theta_{r-1}). The model is left holding the stepped w_{r-1}, where the inner problem starts."""
        eta_a = self.settings.prior_lr
        theta = self.trainer.model.trainable_parameters()
        previous = detached(theta)  # theta_{r-1}
        assign(theta, local)
        _, at_w = self.gradient(*first)
        assign(theta, {name: local[name] - eta_a * at_w[name] for name in local})  # the look-ahead point
        _, look_ahead = self.gradient(*second)
        for name in local:
            local[name].sub_(eta_a * look_ahead[name])
        assign(theta, local)
        return {name: local[name] - self.settings.prior_eta * (memory[name] - previous[name]) for name in local}
