"""BatchNorm inside the concurrent pass off the CPU (`_batch_norm_by_formula`, peradapt.compute.concurrent): on a
GPU cuDNN's training BatchNorm cannot be differentiated under `vmap`, so there BatchNorms compute by their formula.
Checked here on the CPU against `nn.BatchNorm2d` itself, client by client: outputs, gradients, running statistics;
and a whole concurrent round with the formula in place of the kernel against one client after another."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.testing import assert_close

from peradapt.compute.concurrent import ConcurrentSGD, _batch_norm_by_formula
from peradapt.compute.trainer import SGDJob

from .test_concurrent import images, trainer
from .test_perada_authors import perturbed

pytestmark = pytest.mark.usefixtures("one_thread")
CLIENTS, CHANNELS = 3, 4


def norm_states(norm: nn.BatchNorm2d) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    states = []
    for _ in range(CLIENTS):
        state = {name: tensor.clone() for name, tensor in norm.state_dict().items()}
        state["weight"] = 1 + torch.randn(CHANNELS, generator=generator) * 0.1
        state["bias"] = torch.randn(CHANNELS, generator=generator) * 0.1
        state["running_mean"] = torch.randn(CHANNELS, generator=generator)
        state["running_var"] = 1 + torch.rand(CHANNELS, generator=generator)
        states.append(state)
    return states


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("training", [True, False])
def test_the_formula_is_batchnorm2d_client_by_client(training, momentum):
    norm = nn.BatchNorm2d(CHANNELS, momentum=momentum).train(training)
    states = norm_states(norm)
    inputs = torch.randn(CLIENTS, 6, CHANNELS, 5, 5, generator=torch.Generator().manual_seed(1)) * 2 + 0.5

    def loss(parameters, buffers, x):
        with _formula(norm):
            out = functional_call(norm, {**parameters, **buffers}, (x,))
        return (out * torch.arange(out.numel()).reshape(out.shape)).sum() / out.numel(), out

    parameter_names = ("weight", "bias")
    parameters = {n: torch.stack([s[n] for s in states]) for n in parameter_names}
    buffers = {n: torch.stack([s[n] for s in states]) for n in states[0] if n not in parameter_names}
    gradients, outputs = vmap(grad(loss, argnums=(0, 2), has_aux=True))(parameters, buffers, inputs)

    for client, state in enumerate(states):
        alone = nn.BatchNorm2d(CHANNELS, momentum=momentum).train(training)
        alone.load_state_dict(state)
        x = inputs[client].clone().requires_grad_()
        out = alone(x)
        expected_loss = (out * torch.arange(out.numel()).reshape(out.shape)).sum() / out.numel()
        expected_loss.backward()
        assert_close(outputs[client], out.detach(), atol=1e-5, rtol=1e-5)
        assert_close(gradients[0]["weight"][client], alone.weight.grad, atol=1e-5, rtol=1e-5)
        assert_close(gradients[0]["bias"][client], alone.bias.grad, atol=1e-5, rtol=1e-5)
        assert_close(gradients[1][client], x.grad, atol=1e-5, rtol=1e-5)
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            assert_close(buffers[name][client], getattr(alone, name), atol=1e-6, rtol=1e-6, msg=name)
    if training:  # the statistics moved
        assert not torch.equal(buffers["running_mean"][0], states[0]["running_mean"])


class _formula:
    """`norm.forward` as the concurrent pass sets it off the CPU, for the block."""

    def __init__(self, norm: nn.BatchNorm2d) -> None:
        self.norm = norm

    def __enter__(self) -> None:
        self.norm.forward = lambda x: _batch_norm_by_formula(self.norm, x)  # type: ignore[method-assign]

    def __exit__(self, *exc: object) -> None:
        del self.norm.forward


def test_a_concurrent_round_with_the_formula_equals_one_client_after_another():
    """The adapters' BatchNorms train (PerAda's residual adapters): three clients with dropout 0.3, anchors and
    ragged data, the formula in place of the kernel, against `LocalTrainer.sgd` one job after another."""
    trainer_ = trainer(dropout=0.3)
    w = perturbed(trainer_, seed=7)
    jobs = [
        SGDJob(perturbed(trainer_, seed=1), images(13, 1), epochs=2, lr=0.05, seed=101, anchor=w, lam=1.0),
        SGDJob(perturbed(trainer_, seed=2), images(20, 2), epochs=2, lr=0.05, seed=102),
        SGDJob(perturbed(trainer_, seed=3), images(7, 3), epochs=1, lr=0.1, seed=103, anchor=w, lam=0.3),
    ]
    alone = [trainer_.run(job) for job in jobs]
    concurrent = ConcurrentSGD(trainer_)
    concurrent.norm_forward = _batch_norm_by_formula  # as off the CPU
    together = concurrent.run(jobs)
    for (state, loss), (expected, expected_loss) in zip(together, alone, strict=True):
        for name in expected:
            assert_close(state[name], expected[name], atol=2e-5, rtol=2e-5, msg=name)
        assert loss == pytest.approx(expected_loss, rel=1e-5)
