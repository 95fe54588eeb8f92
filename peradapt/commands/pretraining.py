"""`peradapt pretrain`: make a backbone offline, standing in for ImageNet pretraining.

The backbone is trained centrally on the dataset's labeled pretraining split, which the federated clients never
see, and stored where `peradapt train` finds it (or at `--out`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console

from peradapt.adapters.vit import is_vit
from peradapt.backbones import BackboneInfo, create_backbone, default_weights_path, fixed_image_size, save_backbone
from peradapt.backbones.hf import is_hf
from peradapt.compute.trainer import InputPipeline, LocalTrainer, seeded_generator
from peradapt.config import check_output_path
from peradapt.data import ImageSet, iterate_minibatches, pretraining_split
from peradapt.errors import ConfigError, TrainingDiverged
from peradapt.federation.session import resolve_device
from peradapt.options import HELD_OUT_FRACTION, PretrainOptions
from peradapt.progress import counted, progress_display, text_console

# (peak learning rate, weight decay): ResNets train with Nesterov SGD. ViTs train poorly from scratch with SGD, so
# they get AdamW with a ViT's usual weight decay (the tiny ViT, 2 epochs on Fashion-MNIST: 61.5% held-out accuracy
# against SGD's 41.6%).
SGD_DEFAULTS = (0.05, 5e-4)
ADAMW_DEFAULTS = (1e-3, 0.05)


def _weights_path(options: PretrainOptions) -> Path:
    """Where the weights go: --out (checked with the options), or the store `train` looks in, checked here."""
    if options.out is not None:
        return options.out
    out = default_weights_path(options.data, options.backbone)
    check_output_path(out, "the weights store's file (PERADAPT_HOME)", directory=False)
    return out


def pretrain(options: PretrainOptions, console: Console | None = None) -> tuple[Path, float]:
    """Train the backbone; returns where it was stored and its accuracy on held-out pretraining images."""
    console = console or text_console(stderr=True)
    if is_hf(options.backbone):
        raise ConfigError(
            f"{options.backbone}: `peradapt pretrain` makes timm backbones; a Hugging Face model brings its own "
            "weights (pass it to `peradapt train --backbone` as it is)"
        )
    out = _weights_path(options)  # before the data is loaded and the backbone trained
    vit_size = fixed_image_size(options.backbone)  # a ViT's resolution; ResNets train at the native size
    images, source = pretraining_split(
        options.data,
        options.data_dir,
        limit_samples=options.limit_samples,
        download=options.download,
        image_size=vit_size,
    )
    device = resolve_device(options.device)
    torch.manual_seed(options.seed)
    model = create_backbone(options.backbone, images.num_classes, images.images.shape[1]).to(device)
    train_set, held_out = _hold_out(images, options.seed)
    image_size = vit_size or images.images.shape[-1]
    inputs = InputPipeline(source.mean, source.std, device, augment="crop-flip", image_size=image_size)
    optimizer, lr = _optimizer(model, options)
    steps_per_epoch = -(-len(train_set) // options.batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, total_steps=options.epochs * steps_per_epoch, pct_start=0.15
    )
    generator = seeded_generator(options.seed)
    assert train_set.labels is not None
    with progress_display(console) as progress:
        bar = progress.add_task(
            f"pretraining {options.backbone} on {options.data}", total=options.epochs * steps_per_epoch
        )
        for epoch in range(options.epochs):
            model.train()
            for batch in iterate_minibatches(len(train_set), options.batch_size, generator):
                loss = F.cross_entropy(
                    model(inputs(train_set.images[batch], generator)), train_set.labels[batch].to(device)
                )
                if not torch.isfinite(loss):
                    raise TrainingDiverged(f"pretraining loss became {loss.item()}: lower --lr (now {options.lr})")
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
                epochs = f"epoch {epoch + 1}/{options.epochs}"
                progress.update(bar, advance=1, description=f"{epochs} loss {loss.item():.3f}")
    accuracy = _accuracy(model, held_out, inputs)
    info = BackboneInfo(
        backbone=options.backbone,
        in_chans=images.images.shape[1],
        image_size=image_size,
        mean=source.mean,
        std=source.std,
        source=f"peradapt pretrain on {options.data} ({counted(len(train_set), 'image')}, "
        f"{counted(options.epochs, 'epoch')})",
    )
    save_backbone(model.state_dict(), info, out)
    return out, accuracy


def _optimizer(model: torch.nn.Module, options: PretrainOptions) -> tuple[torch.optim.Optimizer, float]:
    """The optimizer for `model` and its peak learning rate: AdamW for ViTs, Nesterov SGD for the others."""
    vit = is_vit(model)
    default_lr, default_decay = ADAMW_DEFAULTS if vit else SGD_DEFAULTS
    lr = default_lr if options.lr is None else options.lr
    decay = default_decay if options.weight_decay is None else options.weight_decay
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
