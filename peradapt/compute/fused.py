"""K clients' training step as one forward and one backward pass of the shared model, without `vmap`.

The K clients' minibatches are one batch of K×B inputs ([K*B, ...], client-major). The frozen backbone sees them as
any batch: every frozen layer is one kernel over the K clients. A module that holds state of the clients' own (an
adapter's projection, BatchNorm or LayerNorm, a LoRA factor, the head) computes each client's part as one batched
kernel over its weights stacked on a leading axis [K, ...], the design of HFTA (Wang et al., MLSys 2021: same-shaped
models fused into one):

- a linear layer, or a 1×1 convolution (the residual adapter's projection), is one batched matrix product: its input
  viewed as [K, B·(positions), C_in] against the weights [K, C_in, C_out] (channels-last images give that view
  without a copy);
- a BatchNorm normalizes each client's channels over its own samples: statistics over the same [K, B·H·W, C] view,
  the running statistics of each client updated with the layer's momentum and the unbiased variance, as
  `nn.BatchNorm2d` does; computed in float32, as `nn.BatchNorm2d` computes under autocast;
- a LayerNorm normalizes each sample as usual and applies each client's affine map;
- a dropout multiplies by the masks `peradapt.compute.concurrent` draws per client.

The loss is the sum over clients of each client's mean loss: since no parameter is shared between clients, one
backward pass of that sum gives each client the gradient of its own mean loss. Compared with
`vmap(grad(...))` (peradapt.compute.concurrent's general path), no operation goes through vmap's batching rules:
the step is the same few hundred kernels as one client's, each K times larger, which is what a GPU needs.

A padded step (`weights` [K, B] of 1 and 0: `ConcurrentSGD._padded_step`, which keeps every lane in every step so
that one captured CUDA graph serves uneven clients) gives each client the loss and the BatchNorm statistics of its
own rows alone, as if it stepped alone on them; a client without rows (done) moves no running statistic.

`fusable` says whether a model can be served so: every module holding per-client state must be one of the kinds
above. Others (a partial model's full convolutions, LoRA's 3×3 factors on a ResNet) take the `vmap` path.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from peradapt.adapters.model import logits_of
from peradapt.errors import ConfigError

RANDOM_DRAWS = (
    "--concurrent-clients: the model draws random numbers outside its nn.Dropout layers (e.g. drop-path or attention "
    "dropout), which cannot be drawn per client: train without --concurrent-clients"
)
# A module's stacked forward: (module, its tensors by local name, stacked [K, ...] or shared, K, input) -> output.
StackedForward = Callable[[nn.Module, dict[str, torch.Tensor], int, torch.Tensor], torch.Tensor]


def _is_pointwise_conv(module: nn.Module) -> bool:
    return (
        isinstance(module, nn.Conv2d)
        and module.kernel_size == (1, 1)
        and module.stride == (1, 1)
        and module.padding in ((0, 0), "valid")
        and module.dilation == (1, 1)
        and module.groups == 1
    )


def _stacked(tensor: torch.Tensor, clients: int, shape: tuple[int, ...]) -> torch.Tensor:
    """`tensor` as [K, *shape]: stacked per client already, or one shared tensor seen by every client."""
    if tensor.dim() == len(shape) + 1:
        return tensor
    return tensor.unsqueeze(0).expand(clients, *shape)


def _products(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, clients: int) -> torch.Tensor:
    """y_k = x_k W_kᵀ + b_k for each client k, one batched product: `rows` [K, N, in], `weight` [K, out, in] or
    shared [out, in], `bias` likewise [K, out], [out] or None; [K, N, out]."""
    out_features, in_features = weight.shape[-2:]
    weights = _stacked(weight, clients, (out_features, in_features)).transpose(1, 2).to(rows.dtype)
    if bias is None:
        return torch.bmm(rows, weights)
    return torch.baddbmm(_stacked(bias, clients, (out_features,)).unsqueeze(1).to(rows.dtype), rows, weights)


def _linear(module: nn.Module, tensors: dict[str, torch.Tensor], clients: int, x: torch.Tensor) -> torch.Tensor:
    """A linear layer per client, over the last axis of `x`."""
    rows = x.reshape(clients, -1, x.shape[-1])
    y = _products(rows, tensors["weight"], tensors.get("bias"), clients)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _channels_as_rows(x: torch.Tensor, clients: int) -> torch.Tensor:
    """[K*B, C, H, W] as [K, B*H*W, C]: a view of channels-last memory, a copy otherwise."""
    return x.permute(0, 2, 3, 1).reshape(clients, -1, x.shape[1])


def _rows_as_channels(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The inverse of `_channels_as_rows`: [K, B*H*W, C] as a channels-last [K*B, C, H, W] like `like`."""
    n, _, h, w = like.shape
    return rows.reshape(n, h, w, -1).permute(0, 3, 1, 2)


def _pointwise_conv(module: nn.Module, tensors: dict[str, torch.Tensor], clients: int, x: torch.Tensor) -> torch.Tensor:
    """A 1×1 convolution per client: the matrix product over channels, as `ChannelProjection.channel_product`."""
    rows = _channels_as_rows(x, clients)
    return _rows_as_channels(_products(rows, tensors["weight"].flatten(-3), tensors.get("bias"), clients), x)


def _batch_norm(
    module: nn.Module, tensors: dict[str, torch.Tensor], clients: int, x: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """`nn.BatchNorm2d` per client (see the module's docstring), on [K*B, C, H, W]. With `rows` (weights [K, B] of
    1 and 0: a padded step, `FusedStep`) each client's statistics are those of its weighted images alone, and a
    client without any (a lane done) moves no running statistic."""
    assert isinstance(module, _BatchNorm)
    channels = x.shape[1]
    values = _channels_as_rows(x, clients).float()
    running_mean, running_var = tensors.get("running_mean"), tensors.get("running_var")
    if module.training or running_mean is None:
        if rows is None:
            var, mean = torch.var_mean(values, dim=1, correction=0)  # [K, C] each
            count: int | torch.Tensor = values.shape[1]
        else:
            positions = values.shape[1] // rows.shape[1]  # H·W
            count = rows.sum(1, keepdim=True) * positions  # [K, 1]
            # A lane without images normalizes its (padding) rows by their own statistics: finite activations
            # (statistics of nothing would scale them by 1/sqrt(eps) at every layer), and no weight in its loss.
            used = torch.where(count > 0, rows, torch.ones_like(rows))
            weights = used.repeat_interleave(positions, dim=1).unsqueeze(2)  # [K, B·H·W, 1]
            total = weights.sum(1)
            mean = (values * weights).sum(1) / total
            var = ((values - mean.unsqueeze(1)).square() * weights).sum(1) / total
        if module.training and running_mean is not None and running_var is not None:
            tracked = tensors["num_batches_tracked"]
            with torch.no_grad():
                _update_running(module, tracked, running_mean, running_var, mean, var, count, rows)
    else:
        mean = _stacked(running_mean, clients, (channels,))
        var = _stacked(running_var, clients, (channels,))  # type: ignore[arg-type]
    scale = torch.rsqrt(var + module.eps)
    if module.affine:
        scale = scale * _stacked(tensors["weight"], clients, (channels,))
        shift = _stacked(tensors["bias"], clients, (channels,)) - mean * scale
    else:
        shift = -mean * scale
    normalized = torch.addcmul(shift.unsqueeze(1), values, scale.unsqueeze(1))
    return _rows_as_channels(normalized.to(x.dtype), x)


def _update_running(
    module: _BatchNorm,
    tracked: torch.Tensor,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    count: int | torch.Tensor,
    rows: torch.Tensor | None,
) -> None:
    """The running statistics moved by the batch's, with the layer's momentum and the unbiased variance, as
    `nn.BatchNorm2d` moves them; with `rows`, only those of clients with images in the step."""
    if rows is None:
        tracked.add_(1)
        momentum: float | torch.Tensor = module.momentum if module.momentum is not None else 0.0
        if module.momentum is None:  # a cumulative average: 1 / batches seen, per client
            momentum = 1.0 / tracked.float().unsqueeze(1)
        running_mean.lerp_(mean.detach(), momentum)
        running_var.lerp_(var.detach() * (count / (count - 1)), momentum)  # the unbiased variance
        return
    assert isinstance(count, torch.Tensor)
    active = (count > 0).float()  # [K, 1]
    tracked.add_(active.squeeze(1).to(tracked.dtype))
    if module.momentum is None:
        momentum = active / tracked.float().clamp(min=1).unsqueeze(1)
    else:
        momentum = active * module.momentum
    unbiased = torch.where(count > 1, count / (count - 1).clamp(min=1), 1.0)
    running_mean.lerp_(mean.detach(), momentum)
    running_var.lerp_(var.detach() * unbiased, momentum)


def _layer_norm(module: nn.Module, tensors: dict[str, torch.Tensor], clients: int, x: torch.Tensor) -> torch.Tensor:
    """`nn.LayerNorm` with each client's affine map."""
    assert isinstance(module, nn.LayerNorm)
    shape = tuple(module.normalized_shape)
    normalized = F.layer_norm(x, shape, eps=module.eps)
    if not module.elementwise_affine:
        return normalized
    width = math.prod(shape)

    def per_client(tensor: torch.Tensor) -> torch.Tensor:  # [K, *shape] or the shared [*shape], as [K, 1, width]
        flat = tensor.reshape(*tensor.shape[: tensor.dim() - len(shape)], width)
        return _stacked(flat, clients, (width,)).unsqueeze(1).to(normalized.dtype)

    rows = normalized.reshape(clients, -1, width)
    weight, bias = per_client(tensors["weight"]), tensors.get("bias")
    out = rows * weight if bias is None else torch.addcmul(per_client(bias), rows, weight)
    return out.reshape(x.shape)


def stacked_forward(module: nn.Module) -> StackedForward | None:
    """How `module` computes its clients' parts at once, or None when it cannot hold state of its clients' own."""
    if isinstance(module, nn.Linear):
        return _linear
    if _is_pointwise_conv(module):
        return _pointwise_conv
    if isinstance(module, _BatchNorm):
        return _batch_norm
    if isinstance(module, nn.LayerNorm):
        return _layer_norm
    return None


def owners(module: nn.Module, keys: list[str]) -> dict[str, tuple[nn.Module, list[str]]]:
    """The modules that own the state `keys`, by name, each with its keys."""
    modules = dict(module.named_modules())
    owned: dict[str, tuple[nn.Module, list[str]]] = {}
    for key in keys:
        name = key.rpartition(".")[0]
        owned.setdefault(name, (modules[name], []))[1].append(key)
    return owned


def fusable(module: nn.Module, keys: list[str]) -> bool:
    """Whether every module holding one of the clients' state `keys` has a stacked forward (`stacked_forward`)."""
    return all(stacked_forward(owner) is not None for owner, _ in owners(module, keys).values())


class FusedStep:
    """One fused forward and backward pass of K clients on `module` (see the module's docstring): each client's
    gradient of its mean loss, and its loss."""

    def __init__(
        self,
        module: nn.Module,
        keys: list[str],
        dropouts: dict[str, nn.Dropout],
        autocast: Callable[[], contextlib.AbstractContextManager],
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        self.module = module
        self.owners = owners(module, keys)
        self.dropouts = dropouts
        self.autocast = autocast
        self.loss = loss  # task_loss(logits, labels, reduction="none"): one loss per sample (per label, multi-label)
        self.draws_checked = False

    def __call__(
        self,
        parameters: dict[str, torch.Tensor],
        fixed: dict[str, torch.Tensor],
        masks: dict[str, list[torch.Tensor]],
        images: torch.Tensor,
        labels: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Gradients of each client's mean loss in the stacked `parameters`, and the K losses (detached); the
        running statistics in `fixed` updated in place. `images` [K, B, ...], `labels` [K, B, ...]; `masks`: per
        dropout, its masks [K, B, ...] one per call in call order. `weights` [K, B] (1 or 0): a padded step, in
        which each client has only the images of weight 1 (fewer than B at the end of its epoch, none once it is
        done): its loss and its BatchNorms' statistics are those of its own images, as if it stepped alone."""
        clients, width = images.shape[:2]
        leaves = {name: tensor.detach().requires_grad_() for name, tensor in parameters.items()}
        flat_masks = {name: [mask.flatten(0, 1) for mask in calls] for name, calls in masks.items()}
        before = None if self.draws_checked else _random_states(images.device)
        with (
            self._stacked_forwards(clients, {**leaves, **fixed}, weights),
            masked_dropouts(self.dropouts, flat_masks),
            self.autocast(),
        ):
            logits = logits_of(self.module(images.flatten(0, 1)))
            per_sample = self.loss(logits.float(), labels.flatten(0, 1)).reshape(clients, width, -1).mean(2)
        if before is not None:  # once: a layer that draws (drop-path) would draw one sample for all clients
            if any(not torch.equal(a, b) for a, b in zip(before, _random_states(images.device), strict=True)):
                raise ConfigError(RANDOM_DRAWS)
            self.draws_checked = True
        # With weights each client's mean over its own images; 0 for a client without any
        losses = per_sample.mean(1) if weights is None else (per_sample * weights).sum(1) / weights.sum(1).clamp(min=1)
        gradients = torch.autograd.grad(losses.sum(), list(leaves.values()))
        return dict(zip(leaves, gradients, strict=True)), losses.detach()

    @contextlib.contextmanager
    def _stacked_forwards(
        self, clients: int, tensors: dict[str, torch.Tensor], weights: torch.Tensor | None
    ) -> Iterator[None]:
        """Each owner of clients' state computes with `tensors` (stacked [K, ...]) and its own shared ones; the
        BatchNorms with the images' `weights` of a padded step."""
        replaced: list[nn.Module] = []
        for name, (owner, keys) in self.owners.items():
            local = {key[len(name) + 1 :] if name else key: tensors[key] for key in keys}
            for local_name, tensor in owner.named_parameters(recurse=False):  # the shared (frozen) ones
                local.setdefault(local_name, tensor)
            forward = stacked_forward(owner)
            assert forward is not None, f"{name} is not fusable"
            if isinstance(owner, _BatchNorm) and weights is not None:
                forward = functools.partial(_batch_norm, rows=weights)
            owner.forward = functools.partial(forward, owner, local, clients)  # type: ignore[method-assign]
            replaced.append(owner)
        try:
            yield
        finally:
            for module in replaced:
                del module.forward


@contextlib.contextmanager
def masked_dropouts(dropouts: dict[str, nn.Dropout], masks: dict[str, list[torch.Tensor]]) -> Iterator[None]:
    """Each training dropout multiplies its input by its next mask of `masks[name]` (drawn ahead, one per call in
    call order); a dropout of rate 0 passes its input."""
    replaced: list[nn.Module] = []
    for name, dropout in dropouts.items():
        if dropout.training:
            queue = collections.deque(masks.get(name, []))
            dropout.forward = functools.partial(_masked, name, queue, dropout.p)  # type: ignore[method-assign]
            replaced.append(dropout)
    try:
        yield
    finally:
        for module in replaced:
            del module.forward


def _random_states(device: torch.device) -> list[torch.Tensor]:
    """The global random generators' states that a forward pass on `device` could advance."""
    states = [torch.random.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _masked(name: str, masks: collections.deque[torch.Tensor], p: float, x: torch.Tensor) -> torch.Tensor:
    """A training dropout: its next mask, drawn ahead for this call."""
    if p == 0:
        return x
    if not masks:
        raise ConfigError(
            f"--concurrent-clients: the model's dropout {name} runs where a pass in evaluation mode does not, so its "
            "masks cannot be drawn ahead: train without --concurrent-clients"
        )
    return x * masks.popleft().to(x.dtype)
