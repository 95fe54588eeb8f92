"""PerAda's adapter training step before and after the speed work of issue 6, interleaved in one process.

    python benchmarks/step_before_after.py [--threads N] [--repeats R]

Three versions of the same model, all running `LocalTrainer.sgd` with an anchor on the same batches:
- before: inputs and weights in contiguous (NCHW) memory, `nn.Dropout` and a 1x1 `nn.Conv2d` in every residual
  adapter, plain `nn.Conv2d` in the backbone, as peradapt had them;
- channels-last: channels-last inputs and weights, `AdapterDropout` and `ChannelProjection`
  (`peradapt.adapters.branch`, commit e2b5111), plain `nn.Conv2d` in the backbone;
- after: as peradapt runs now, the frozen backbone's convolutions also `SmallInputConv2d`
  (`peradapt.backbones.small_inputs`: 2x2 and 1x1 feature maps as one matrix product).
The figures are images per second of each and ratios to before, medians over the repetitions (see bench.py).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench import LAM, LR, Settings, adapted_trainer, interleaved, median_ratio, perturbed, random_images
from torch import nn

from peradapt.adapters.branch import AdapterDropout, ChannelProjection
from peradapt.backbones.small_inputs import SmallInputConv2d
from peradapt.compute.trainer import InputPipeline, LocalTrainer


class ContiguousPipeline(InputPipeline):
    def __call__(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return super().__call__(images, generator).contiguous()


def plain_convolutions(trainer: LocalTrainer) -> LocalTrainer:
    for module in trainer.model.module.modules():
        if isinstance(module, SmallInputConv2d):
            module.__class__ = nn.Conv2d
    return trainer


def before(trainer: LocalTrainer) -> LocalTrainer:
    """The same model in the layout and with the modules of before."""
    plain_convolutions(trainer).model.module.to(memory_format=torch.contiguous_format)
    for module in trainer.model.module.modules():
        if isinstance(module, AdapterDropout):
            module.__class__ = nn.Dropout
        elif isinstance(module, ChannelProjection):
            module.__class__ = nn.Conv2d
    old = trainer.inputs
    return LocalTrainer(trainer.model, ContiguousPipeline(old.mean, old.std, old.device), trainer.batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings = Settings()
    data = random_images(settings.batch_size * settings.step_batches, settings, seed=1)
    trainers = {
        "before": before(adapted_trainer(settings)),
        "channels-last": plain_convolutions(adapted_trainer(settings)),
        "after": adapted_trainer(settings),
    }
    start, anchor = trainers["after"].model.state(), perturbed(trainers["after"].model, seed=2)

    def step(trainer: LocalTrainer) -> None:
        trainer.sgd(start, data, epochs=1, lr=LR, seed=0, anchor=anchor, lam=LAM)

    times = interleaved({name: (lambda t=t: step(t)) for name, t in trainers.items()}, args.repeats)
    for name, seconds in times.items():
        speedup = median_ratio(times["before"], seconds)
        print(f"{name}: {len(data) / statistics.median(seconds):.1f} images/s, {speedup:.3f}x before")
    print(f"threads: {args.threads}")


if __name__ == "__main__":
    main()
