"""Issue 6's stretch goal, measured: several clients' adapter steps in one batched pass through the shared backbone.

    python benchmarks/batched_clients.py [--clients K] [--threads N] [--repeats R]

One after another (what peradapt does): K clients each take one SGD step of `LocalTrainer.sgd` on a batch of their
own. Batched: `torch.func.vmap` over the K clients' adapter states (parameters and trainable BatchNorms' statistics
stacked on a leading axis) and their K batches, around `torch.func.grad` of one client's loss through the shared
frozen backbone, so every frozen convolution runs once on the K batches together; the timed part is the gradients
alone, no optimizer step, which favours the batched side. The figure is the median ratio of the two times,
interleaved (see bench.py). On CPU the batched pass is slower: peradapt keeps clients one after another.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from bench import LR, QUICK, adapted_trainer, interleaved, median_ratio, perturbed, random_images
from torch import nn
from torch.func import functional_call, grad, vmap

from peradapt.adapters.branch import AdapterDropout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings = QUICK
    trainer = adapted_trainer(settings)
    model, module = trainer.model, trainer.model.module
    batches = [random_images(settings.batch_size, settings, seed=50 + k) for k in range(args.clients)]
    states = [perturbed(model, seed=k) for k in range(args.clients)]

    trainable = set(model.trainable_parameters())
    client_buffers = set(model.state()) - trainable
    frozen = {n: p for n, p in module.named_parameters() if n not in trainable}
    frozen |= {n: b for n, b in module.named_buffers() if n not in client_buffers}
    stacked = {name: torch.stack([state[name] for state in states]) for name in states[0]}
    inputs = torch.stack([trainer.inputs(batch.images) for batch in batches])
    labels = torch.stack([batch.labels for batch in batches])

    def client_loss(parameters: dict, buffers: dict, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(module, {**frozen, **parameters, **buffers}, (images,)), targets)

    batched_gradients = vmap(grad(client_loss), randomness="different")

    def batched() -> None:
        # peradapt's dropout draws its own bits, which vmap cannot split by client; nn.Dropout's kernel can.
        dropouts = [m for m in module.modules() if isinstance(m, AdapterDropout)]
        for dropout in dropouts:
            dropout.__class__ = nn.Dropout
        model.train()
        parameters = {name: stacked[name] for name in trainable}
        buffers = {name: stacked[name].clone() for name in client_buffers}
        batched_gradients(parameters, buffers, inputs, labels)
        for dropout in dropouts:
            dropout.__class__ = AdapterDropout

    def one_after_another() -> None:
        for state, batch in zip(states, batches, strict=True):
            trainer.sgd(state, batch, epochs=1, lr=LR, seed=0)

    times = interleaved({"batched": batched, "one_after_another": one_after_another}, args.repeats)
    images = args.clients * settings.batch_size
    for name, seconds in times.items():
        print(f"{name}: {images / statistics.median(seconds):.1f} images/s")
    ratio = median_ratio(times["one_after_another"], times["batched"])
    print(f"batched speed / one after another: {ratio:.3f} ({args.clients} clients, threads {args.threads})")


if __name__ == "__main__":
    main()
