"""`peradapt pretrain`: make a backbone offline, standing in for ImageNet pretraining.

The backbone is trained centrally on the dataset's labeled pretraining split, which the federated clients never
see, and stored where `peradapt train` finds it (or at `--out`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console

from peradapt.adapters.vit import is_vit
from peradapt.backbones import BackboneInfo, create_backbone, default_weights_path, fixed_image_size, save_backbone
from peradapt.backbones.hf import is_hf
from peradapt.compute.trainer import InputPipeline, LocalTrainer, seeded_generator
from peradapt.config import MIN_BATCH_SIZE, check_output_path
from peradapt.data import ImageSet, iterate_minibatches, pretraining_split
from peradapt.errors import ConfigError, TrainingDiverged
from peradapt.federation.session import resolve_device
from peradapt.progress import counted, progress_display, text_console
from peradapt.settings import FLOAT32_MAX

HELD_OUT_FRACTION = 0.1  # of the pretraining split, only to report how good the backbone is
# (peak learning rate, weight decay): ResNets train with Nesterov SGD. ViTs train poorly from scratch with SGD, so
# they get AdamW with a ViT's usual weight decay (the tiny ViT, 2 epochs on Fashion-MNIST: 61.5% held-out accuracy
# against SGD's 41.6%).
SGD_DEFAULTS = (0.05, 5e-4)
ADAMW_DEFAULTS = (1e-3, 0.05)
# One image held out (at least), and a batch for BatchNorm left to train on.
MIN_PRETRAIN_SAMPLES = 1 + MIN_BATCH_SIZE


@dataclass
class PretrainConfig:
    data: str = "fmnist"
    backbone: str = "resnet18"
    epochs: int = 5
    batch_size: int = 128
    lr: float | None = None  # None: the optimizer's default (SGD_DEFAULTS, ADAMW_DEFAULTS)
    weight_decay: float | None = None
    limit_samples: int | None = None
    data_dir: str | None = None
    download: bool = False
    out: str | None = None
    seed: int = 0
    device: str = "auto"

    def validate(self) -> None:
        if is_hf(self.backbone):
            raise ConfigError(
                f"{self.backbone}: `peradapt pretrain` makes timm backbones; a Hugging Face model brings its own "
                "weights (pass it to `peradapt train --backbone` as it is)"
            )
        if self.lr is not None and not (math.isfinite(self.lr) and 0 < self.lr <= FLOAT32_MAX):
            raise ConfigError(
                f"--lr must be a positive finite number no larger than {FLOAT32_MAX:.4g} (training computes in "
                f"float32), got {self.lr}"
            )
        decay = self.weight_decay
        if decay is not None and not (math.isfinite(decay) and 0 <= decay <= FLOAT32_MAX):
            raise ConfigError(f"weight_decay must be a finite number, 0 or more, got {decay}")
        if self.epochs < 1:
            raise ConfigError(f"--epochs must be at least 1, got {self.epochs}")
        if self.batch_size < MIN_BATCH_SIZE:
            raise ConfigError(
                f"--batch-size must be at least {MIN_BATCH_SIZE}, got {self.batch_size}: the backbone's BatchNorm "
                "layers train on each batch's statistics, which one sample has not"
            )
        if self.limit_samples is not None and self.limit_samples < MIN_PRETRAIN_SAMPLES:
            raise ConfigError(
                f"--limit-samples must be at least {MIN_PRETRAIN_SAMPLES} for pretraining, got {self.limit_samples}: "
                f"{HELD_OUT_FRACTION:.0%} of the images (1 at least) are held out to measure the backbone, and a "
                f"batch of {MIN_BATCH_SIZE} must be left to train on"
            )
        if not 0 <= self.seed < 2**63:  # the range torch's generators take
            raise ConfigError(f"--seed must be between 0 and 2^63 - 1, got {self.seed}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"--device must be auto, cpu or cuda, got '{self.device}'")
        if self.out is not None and Path(self.out).suffix.lower() == ".json":
            raise ConfigError(
                f"--out {self.out}: the weights' description is written beside them as .json; "
                "give the weights a .safetensors name"
            )

    def out_path(self) -> Path:
        """Where the weights go: --out, or the store `train` looks in; checked to be a writable file path."""
        if self.out:
            check_output_path(Path(self.out), "--out", directory=False)
            return Path(self.out)
        out = default_weights_path(self.data, self.backbone)
        check_output_path(out, "the weights store's file (PERADAPT_HOME)", directory=False)
        return out


def pretrain(config: PretrainConfig, console: Console | None = None) -> tuple[Path, float]:
    """Train the backbone; returns where it was stored and its accuracy on held-out pretraining images."""
    console = console or text_console(stderr=True)
    config.validate()
    out = config.out_path()  # before the data is loaded and the backbone trained
    vit_size = fixed_image_size(config.backbone)  # a ViT's resolution; ResNets train at the native size
    images, source = pretraining_split(
        config.data, config.data_dir, limit_samples=config.limit_samples, download=config.download, image_size=vit_size
    )
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    model = create_backbone(config.backbone, images.num_classes, images.images.shape[1]).to(device)
    train_set, held_out = _hold_out(images, config.seed)
    image_size = vit_size or images.images.shape[-1]
    inputs = InputPipeline(source.mean, source.std, device, augment="crop-flip", image_size=image_size)
    optimizer, lr = _optimizer(model, config)
    steps_per_epoch = -(-len(train_set) // config.batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, total_steps=config.epochs * steps_per_epoch, pct_start=0.15
    )
    generator = seeded_generator(config.seed)
    assert train_set.labels is not None
    with progress_display(console) as progress:
        bar = progress.add_task(
            f"pretraining {config.backbone} on {config.data}", total=config.epochs * steps_per_epoch
        )
        for epoch in range(config.epochs):
            model.train()
            for batch in iterate_minibatches(len(train_set), config.batch_size, generator):
                loss = F.cross_entropy(
                    model(inputs(train_set.images[batch], generator)), train_set.labels[batch].to(device)
                )
                if not torch.isfinite(loss):
                    raise TrainingDiverged(f"pretraining loss became {loss.item()}: lower --lr (now {config.lr})")
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
                progress.update(bar, advance=1, description=f"epoch {epoch + 1}/{config.epochs} loss {loss.item():.3f}")
    accuracy = _accuracy(model, held_out, inputs)
    info = BackboneInfo(
        backbone=config.backbone,
        in_chans=images.images.shape[1],
        image_size=image_size,
        mean=source.mean,
        std=source.std,
        source=f"peradapt pretrain on {config.data} ({counted(len(train_set), 'image')}, "
        f"{counted(config.epochs, 'epoch')})",
    )
    save_backbone(model.state_dict(), info, out)
    return out, accuracy


def _optimizer(model: torch.nn.Module, config: PretrainConfig) -> tuple[torch.optim.Optimizer, float]:
    """The optimizer for `model` and its peak learning rate: AdamW for ViTs, Nesterov SGD for the others."""
    vit = is_vit(model)
    default_lr, default_decay = ADAMW_DEFAULTS if vit else SGD_DEFAULTS
    lr = default_lr if config.lr is None else config.lr
    decay = default_decay if config.weight_decay is None else config.weight_decay
    if vit:
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=decay), lr
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=decay), lr


def _hold_out(images: ImageSet, seed: int) -> tuple[ImageSet, ImageSet]:
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))
    held = max(1, int(len(images) * HELD_OUT_FRACTION))
    return images.subset(order[held:]), images.subset(order[:held])


def _accuracy(model: torch.nn.Module, data: ImageSet, inputs: InputPipeline) -> float:
    """Held-out accuracy, reusing the trainer's batched inference on a plain (adapter-free) model."""
    model.eval()
    assert data.labels is not None
    with torch.inference_mode():
        predictions = torch.cat(
            [
                model(inputs(data.images[start : start + LocalTrainer.eval_batch_size])).argmax(1).cpu()
                for start in range(0, len(data), LocalTrainer.eval_batch_size)
            ]
        )
    return (predictions == data.labels).float().mean().item()
