"""Body/head methods: a shared body (feature extractor) averaged by the server, and a classifier head that is not.

The network splits into the body phi (every state entry but the classifier's) and the head h (the classifier:
`classifier_name`, the task's new head that `load_backbone` initializes at random from --seed). All three are
full-model baselines (scope `full`), built on `partial.PartialSGD`: the client uploads its body only, and the
server replaces the global body by the mean of the sampled clients' bodies.

FedPer (Arivazhagan et al., "Federated Learning with Personalization Layers", 2019, Algorithms 1-2): base layers
shared, personalization layers (here the head; --personal-part picks others) kept by each client. The client
trains both together, E = --local-epochs epochs of SGD from (phi, h_m), and the server takes the sample-weighted
mean phi <- sum_m n_m phi_m / sum_m n_m. It is FedSim with the head personal.

FedRep (Collins et al., "Exploiting Shared Representations for Personalized Federated Learning", ICML 2021,
Algorithm 1): client m first trains its head with the body fixed, then the body with the new head fixed,

    h_m   <- h_m - alpha * grad_h f_m(phi, h_m)          tau_h = --personal-epochs epochs (Sec. 5: 10)
    phi_m <- phi;  phi_m <- phi_m - eta * grad_phi f_m(phi_m, h_m)   --body-epochs epochs (Sec. 5: 1, or 5)

and the server averages uniformly, phi <- (1/|I^t|) sum_{m in I^t} phi_m (Algorithm 1; `--aggregation samples`
weights by n_m as the authors' code does on FEMNIST/Sent140 and PFLlib always). alpha = --personal-lr (default
--lr), eta = --lr. It is FedAlt with the head personal and its own body epochs (--local-epochs is not used).

FedBABU (Oh, Kim & Yun, "FedBABU: Toward Enhanced Representation for Federated Image Classification", ICLR 2022,
Algorithm 1): the head stays at its random initialization h^0 for the whole federated training and is never
sent. Client m trains the body only from the global model, tau = --local-epochs epochs with the head frozen,

    phi_m <- phi;  phi_m <- phi_m - eta * grad_phi f_m(phi_m, h^0)

and the server takes phi <- sum_m n_m phi_m / sum_m n_m. Personalization happens at evaluation: each client
fine-tunes the whole global model (phi, h^0), body and head, on its own data for --ft-epochs (default 5, the
authors' evaluation) at --personal-lr (default --lr), as FedAvg+FT does (`fedavg.FineTuning`).
"""

from __future__ import annotations

from dataclasses import dataclass

from peradapt.adapters import AdapterState
from peradapt.data import ClientData, ImageSet
from peradapt.errors import ConfigError
from peradapt.methods.base import ClientSteps, ClientUpdate, MethodContext, register
from peradapt.methods.fedavg import FineTuning, FineTuningSettings
from peradapt.methods.partial import FedAlt, FedSim, LocalSteps, PartialModelSettings, PartialSGD, subset
from peradapt.seeds import LOCAL, derive_seed
from peradapt.settings import setting

HEAD = "head"


@dataclass
class FedRepSettings(PartialModelSettings):
    body_epochs: int = setting(
        1,
        help="FedRep: epochs on the shared body after --personal-epochs on the head (it ignores --local-epochs; "
        "Collins et al.: 1, 5 on some datasets).",
        minimum=1,
    )


@dataclass
class FedBABUSettings(FineTuningSettings, PartialModelSettings):
    """Fine-tuning's settings and the partial-model methods' --personal-part (which may only name the head)."""


@register
class FedPer(FedSim):
    name = "fedper"
    summary = "FedPer: base layers averaged, personalization layers (the head) local (Arivazhagan et al. 2019)"
    default_part = HEAD


@register
class FedRep(FedAlt):
    name = "fedrep"
    summary = "FedRep: personal head trained first, then the shared body (Collins et al. 2021, Algorithm 1)"
    default_part = HEAD
    default_aggregation = "uniform"
    settings_class = FedRepSettings
    settings: FedRepSettings

    @property
    def shared_epochs(self) -> int:
        return self.settings.body_epochs


@register
class FedBABU(FineTuning, PartialSGD):
    name = "fedbabu"
    summary = "FedBABU: body averaged, head fixed at its random init, whole model fine-tuned per client (Oh et al.)"
    default_part = HEAD  # the part that stays at its initialization, not a personal one
    default_ft_epochs = 5
    settings_class = FedBABUSettings
    settings: FedBABUSettings

    def __init__(self, context: MethodContext) -> None:
        if context.settings is not None and context.settings.personal_part not in (None, HEAD, "output"):
            raise ConfigError("--method fedbabu keeps the classifier head at its initialization: drop --personal-part")
        super().__init__(context)

    def local_steps(self, start: AdapterState, data: ImageSet, seed: int) -> LocalSteps:
        """tau epochs of SGD on the body, the head frozen at h^0 (Algorithm 1, ClientBodyUpdate)."""
        config = self.config
        state, loss = yield self.part_job(
            start,
            data,
            self.shared,
            epochs=config.local_epochs,
            steps=config.local_steps,
            seed=derive_seed(seed, LOCAL),
        )
        return state, {"local_loss": loss}

    def client_steps(self, client: ClientData, global_state: AdapterState, seed: int) -> ClientSteps:
        """From the global model (phi, h^0); only the body goes back, and nothing stays on the client."""
        state, metrics = yield from self.local_steps(global_state, client.train, seed)
        return ClientUpdate(client.client_id, subset(state, self.shared), len(client.train), metrics)

    def client_samples_bound(self, client: ClientData) -> int:
        return self.local_samples(client)
