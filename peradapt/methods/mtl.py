"""MTL: federated multi-task learning, a model per client coupled through a task-relationship matrix Ω.

Smith, Chiang, Sanjabi & Talwalkar, "Federated Multi-Task Learning" (NeurIPS 2017), problem (1) with the
regularizer tr(W Ω Wᵀ) of (2), as PerAda runs it as a full-model baseline ("MTL [57]", Xie et al., CVPR 2024,
Table 1: a full model personalized and sent per client, and no global model). With W = [w_1, ..., w_M] the models of
the M clients of the federation (sampled or not) and L_k client k's mean training loss:

    min_W  Σ_k L_k(w_k) + λ/2 tr(W Ω Wᵀ)

A sampled client k takes its share of the W-step (MOCHA, Algorithm 1): E epochs of SGD from its own w_k with the
other clients' models fixed, whose gradient is

    ∇L_k(w_k) + λ (W Ω)_k = ∇L_k(w_k) + λ Ω_kk (w_k - a_k),      a_k = -(1/Ω_kk) Σ_{j≠k} Ω_kj w_j,

i.e. proximal SGD towards the anchor a_k with strength λ Ω_kk (`LocalTrainer.sgd`, DP-SGD under --dp-noise). The
client keeps w_k, is evaluated and exported with it (w^0 before its first round), and uploads it. λ is --lam;
--lam 0 trains every client alone, which is what PFLlib's FedMTL computes (its regularizer carries no gradient). A
client with --lr · λ Ω_kk ≥ 2 stops the run with advice: SGD steps on the pull alone would diverge.

The server keeps every client's latest model as server state, saved in every round checkpoint: M models on the
CPU, so M times the model in memory and in each checkpoint (a full ResNet-18 is 45 MB: 900 MB for M = 20), beside
the copy each client keeps in the client store. It sends client k a payload of its own, one model: a_k (with
Ω_kk), so no client needs the others' models. Ω is --mtl-omega:

    mean     Ω = (I - 11ᵀ/M)², fixed: mean-regularized MTL, one of the instances of (1) the paper names, where
             tr(W Ω Wᵀ) = Σ_k ||w_k - w̄||², a_k is the mean of the other clients' models and Ω_kk = (M - 1)/M.
    learned  MOCHA's Ω-step ("update Ω centrally", Algorithm 1) after every round, as the authors' code
             (run_mocha.m) learns it: Σ = (WᵀW)^{1/2} / tr((WᵀW)^{1/2}), Ω = Σ⁻¹, starting from Σ = I/M (round 1's
             penalty is the ridge term λM/2 ||w_k||²). WᵀW is the Gram matrix of the clients' trainable
             parameters, its eigenvalues floored at 1e-7 so that Ω exists. Models that differ little from one
             another make Ω large (it weighs their differences by the inverse of their size): use a small --lam.

The global state is the mean model w̄ = (1/M) Σ_k w_k over all M clients' latest models: bookkeeping only, which no
client trains from. The report's "global" rows evaluate it and `global/` exports it; PerAda has no MTL row in its
Table 2 of global models. Running statistics are not regularized; the server's copies follow the uploads.

A new client (`peradapt personalize`) joins as task M + 1 with the others fixed: E epochs from w̄ with the anchor w̄
and strength λ M / (M + 1), the mean-regularized rule (a learned Ω has no row for a task outside W).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from peradapt.adapters import AdapterState
from peradapt.data import ClientData
from peradapt.errors import TrainingDiverged
from peradapt.methods.base import PERSONAL_KEY, ClientSteps, ClientUpdate, LocalSGDMethod, MethodContext, register
from peradapt.settings import Search, setting

OMEGAS = ("mean", "learned")
OMEGA_KK = "mtl.omega_kk"  # the payload's entry holding Ω_kk beside the anchor a_k
MODELS_PREFIX = "models/"  # server state: one tensor [M, ...] per entry of the model state
OMEGA_STATE = "omega"
EIGENVALUE_FLOOR = 1e-7  # the authors' run_mocha.m


def mean_regularized_omega(m: int) -> torch.Tensor:
    centering = torch.eye(m, dtype=torch.float64) - torch.full((m, m), 1 / m, dtype=torch.float64)
    return centering @ centering


def relationship_omega(gram: torch.Tensor) -> torch.Tensor:
    """Ω = Σ⁻¹ with Σ = (WᵀW)^{1/2} / tr((WᵀW)^{1/2}): the closed-form Ω-step of the Gram matrix WᵀW."""
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)
    roots = eigenvalues.clamp_min(EIGENVALUE_FLOOR).sqrt()
    return eigenvectors @ torch.diag(roots.sum() / roots) @ eigenvectors.T


@dataclass
class MTLSettings:
    mtl_omega: str = setting(
        "mean",
        help="MTL task relationships Ω: mean (fixed (I - 11ᵀ/M)², mean-regularized) or learned (MOCHA's Ω-step "
        "every round, as the authors' code).",
        choices=OMEGAS,
        symbol="Ω",
    )


@register
class MTL(LocalSGDMethod):
    name = "mtl"
    summary = "federated multi-task learning: a model per client, tr(WΩWᵀ) couples them (Smith et al. 2017)"
    default_aggregation = None  # the server keeps every client's model, it averages nothing
    default_scope = "full"  # PerAda Table 1: "MTL, Full model"
    supports_dp = True
    settings_class = MTLSettings
    # the coupling strength λ; PerAda gives MTL no range of its own: the shared one
    tunes: ClassVar[Mapping[str, Search | None]] = {"lam": None}
    settings: MTLSettings

    def __init__(self, context: MethodContext) -> None:
        super().__init__(context)
        self.num_clients = context.federated if context.federated is not None else len(context.clients)  # M
        self.trainable = list(self.trainer.model.trainable_parameters())
        self.load_server_state({})

    def initial_omega(self) -> torch.Tensor:
        m = self.num_clients
        if self.settings.mtl_omega == "mean":
            return mean_regularized_omega(m)
        return m * torch.eye(m, dtype=torch.float64)  # Σ = I/M

    def server_state(self) -> dict[str, torch.Tensor]:
        models = {MODELS_PREFIX + name: stacked for name, stacked in self.models.items()}
        return {OMEGA_STATE: self.omega, **models}

    def load_server_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Every client's latest model and Ω; a fresh run: every client at w^0 and the initial Ω."""
        if tensors:
            self.omega = tensors[OMEGA_STATE].cpu()
            self.models = {k[len(MODELS_PREFIX) :]: v.cpu() for k, v in tensors.items() if k.startswith(MODELS_PREFIX)}
            return
        self.omega = self.initial_omega()
        m = self.num_clients
        self.models = {
            k: v.detach().cpu().unsqueeze(0).repeat(m, *[1] * v.dim()) for k, v in self.context.initial.items()
        }

    def payload(self, client_id: int, global_state: AdapterState) -> AdapterState:
        """a_k = -(1/Ω_kk) Σ_{j≠k} Ω_kj w_j for the trainable entries, and Ω_kk."""
        row = self.omega[client_id].clone()
        diagonal = float(row[client_id])
        row[client_id] = 0.0
        device = next(iter(global_state.values())).device
        payload = {OMEGA_KK: torch.tensor([diagonal], dtype=torch.float64, device=device)}
        if diagonal == 0.0:  # no coupling (M = 1): the client trains alone
            return payload
        for name in self.trainable:
            others = torch.tensordot(row.to(self.models[name].dtype), self.models[name], dims=1)
            payload[name] = (-others / diagonal).to(device)
        return payload

    def client_steps(self, client: ClientData, global_state: AdapterState, seed: int) -> ClientSteps:
        """E epochs of w_k <- w_k - eta (grad L_k(w_k) + lam Ω_kk (w_k - a_k)); `global_state` is the payload."""
        config = self.config
        strength = config.lam * float(global_state[OMEGA_KK])
        if config.lr * strength >= 2:  # SGD on lam/2 Ω_kk ||w_k - a_k||² alone would move away from a_k
            raise TrainingDiverged(
                f"MTL's pull lam·Ω_kk = {strength:.4g} on client {client.client_id} times --lr {config.lr} is at "
                f"least 2, where its steps diverge: lower --lam (now {config.lam})"
            )
        own, loss = yield self.local_job(
            client,
            self.personalized(client.client_id, global_state),
            seed,
            anchor=global_state,
            lam=strength,
        )
        self.store.put(client.client_id, PERSONAL_KEY, own)
        return ClientUpdate(client.client_id, own, len(client.train), {"local_loss": loss})

    def client_samples_bound(self, client: ClientData) -> int:
        return self.local_samples(client)

    def server_update(
        self,
        global_state: AdapterState,
        updates: list[ClientUpdate],
        seed: int,
        round_index: int,
        on_step: Callable[[int], None] | None = None,
    ) -> tuple[AdapterState, dict[str, float]]:
        """Replace the uploaders' columns of W, take the Ω-step (learned Ω), return w̄."""
        for update in updates:
            for name, tensor in update.upload.items():
                self.models[name][update.client_id] = tensor.detach().cpu()
        if self.settings.mtl_omega == "learned":
            self.omega = relationship_omega(self.gram())
        device = next(iter(global_state.values())).device
        mean = {k: (v.mean(0) if v.is_floating_point() else v[0]).to(device) for k, v in self.models.items()}
        return mean, {}

    def gram(self) -> torch.Tensor:
        """WᵀW over the trainable parameters, accumulated tensor by tensor (never the whole W in float64)."""
        gram = torch.zeros(self.num_clients, self.num_clients, dtype=torch.float64)
        for name in self.trainable:
            columns = self.models[name].flatten(1).double()
            gram += columns @ columns.T
        return gram

    def personalized(self, client_id: int, global_state: AdapterState) -> AdapterState:
        return self.store.get(client_id, PERSONAL_KEY) or self.context.initial

    def personalize_new_client(self, client: ClientData, global_state: AdapterState, seed: int) -> AdapterState:
        """Task M + 1 with the federation's models fixed: anchor w̄, strength lam M / (M + 1), from w̄."""
        config, m = self.config, self.num_clients
        own, _ = self.trainer.run(
            self.local_job(client, global_state, seed, anchor=global_state, lam=config.lam * m / (m + 1))
        )
        return own
