"""One frozen backbone with adapters injected through PEFT, shared by every client.

A client's adapter is an `AdapterState`: a flat dict from the PEFT model's parameter/buffer names to tensors,
holding the trainable parameters and the running statistics of the trainable BatchNorm layers. Switching
clients copies such a dict into the shared model; the backbone is never copied.
"""

from __future__ import annotations

import functools
import json
import re
import tempfile
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from timm.models.resnet import BasicBlock
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from peradapt.adapters.residual import RESIDUAL_INIT
from peradapt.adapters.state import AdapterState
from peradapt.adapters.vit import block_layer_norms, is_vit, linear_layers, mlp_outputs
from peradapt.backbones import classifier_name
from peradapt.errors import ConfigError, WeightsError

ADAPTER_KINDS = ("residual", "lora", "none")
SCOPES = ("adapter", "full")
FULL_MODEL_FILE = "model.safetensors"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
PEFT_CARD_FILE = "README.md"  # PEFT's empty model-card template, left out of saved adapters
# The entries of adapter_config.json that say which adapter it is: another value is an adapter of another model.
_DESCRIBING_KEYS = ("peft_type", "init_lora_weights", "r", "lora_alpha", "target_modules", "modules_to_save")
# `--frozen-bn train`: the frozen BatchNorms' running statistics, which PEFT does not save, beside the adapter.
FROZEN_NORMS_FILE = "frozen_bn_statistics.safetensors"
# The second, personal classifier a method may ask for (`Method.second_head`), a module of the base network.
PERSONAL_HEAD = "personal_head"


class AdaptedModel:
    """The shared model and what trains in it: adapters (scope `adapter`) or the whole network (scope `full`)."""

    def __init__(self, module: nn.Module, kind: str, scope: str = "adapter", frozen_bn: str = "eval") -> None:
        """`frozen_bn`: how the frozen backbone's BatchNorms behave in training mode: `eval` (their pretrained
        statistics; nothing of theirs trains) or `train` (batch statistics, with running statistics re-estimated
        on each client's data, as `model.train()` on the whole network does in the PerAda authors' code). With
        `train` their running statistics change with training, so they become part of every adapter state."""
        if frozen_bn not in ("eval", "train"):
            raise ConfigError(f"unknown --frozen-bn '{frozen_bn}': use eval or train")
        # The layout of the inputs `to_model_input` makes: weights in another would be reordered at every call.
        self.module = module.to(memory_format=torch.channels_last)
        self.kind = kind
        self.scope = scope
        self.frozen_bn = frozen_bn
        self._parameters = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self._buffers: dict[str, torch.Tensor] = {}
        self._frozen_norms: list[nn.Module] = []
        self._frozen_norm_buffers: set[str] = set()  # in the state only with frozen_bn "train"
        for module_name, layer in module.named_modules():
            owns_trainable = any(p.requires_grad for p in layer.parameters(recurse=False))
            # PEFT keeps an unused copy (`original_module`) of every module it trains: no forward pass reaches it.
            frozen_norm = not owns_trainable and isinstance(layer, _BatchNorm) and "original_module" not in module_name
            if frozen_norm:
                self._frozen_norms.append(layer)
            if owns_trainable or (frozen_norm and frozen_bn == "train"):
                for buffer_name, buffer in layer.named_buffers(recurse=False):
                    self._buffers[f"{module_name}.{buffer_name}"] = buffer
                    if frozen_norm:
                        self._frozen_norm_buffers.add(f"{module_name}.{buffer_name}")
        self.personal_head: nn.Linear | None = None  # see `add_personal_head`
        self._personal_head_keys: dict[str, str] = {}  # its state keys -> the classifier's (same parameter)
        self._split: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # collects (generic, personal) logits
        self._detach_features = False

    @property
    def device(self) -> torch.device:
        return next(iter(self._parameters.values())).device

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        """The trainable parameters, by their state keys: the live `nn.Parameter`s of the shared model, not copies
        (they change as it trains and as states are loaded; `state()` copies). Its keys are the optimization
        variables of a state, without the BatchNorm running statistics the state holds besides."""
        return self._parameters

    def num_trainable(self) -> int:
        """The number of trainable parameters (elements), per client the size of one model's update."""
        return sum(p.numel() for p in self._parameters.values())

    @property
    def base_model(self) -> nn.Module:
        """The network without PEFT's wrapper (itself when no adapter is injected: `--adapter none`)."""
        return self.module.get_base_model() if isinstance(self.module, PeftModel) else self.module

    def classifier_name(self) -> str:
        """The classifier's module name in `module`, the prefix of its entries in a state (PEFT's wrapper included)."""
        return classifier_name(self.module)

    def backbone_state(self) -> dict[str, torch.Tensor]:
        """The base network's own tensors under its own names (PEFT keeps them as `base_layer` / `original_module`
        beside its LoRA factors and trainable copies, which are left out, as is a personal head)."""
        return {
            name.replace(".original_module", "").replace(".base_layer", ""): tensor
            for name, tensor in self.base_model.state_dict().items()
            if not _is_added(name)
        }

    def num_backbone(self) -> int:
        """Parameters of the model a user would run without adapters (PEFT's saved copies excluded)."""
        return sum(p.numel() for n, p in self.base_model.named_parameters() if not _is_added(n))

    def add_personal_head(self) -> None:
        """A second linear head beside the classifier, of the same sizes, trainable and part of every state; the
        model's logits become generic(h) + personal(h), h the classifier's input (FedRoD's personalized model).

        It starts at zero, so the initial state (and any state whose personal head is zero, such as a global one
        whose personal entries the server leaves as they are) predicts with the generic classifier alone. It is no
        PEFT layer: its tensors are saved among the adapter's under their own names, which PEFT loads into a base
        network that has a `personal_head` module and skips otherwise (the generic model).
        """
        if self.personal_head is not None:
            raise ValueError("the model already has a personal head")
        base, name = self.base_model, classifier_name(self.base_model)
        classifier = base.get_submodule(name)
        linear = _active_linear(classifier)
        if not isinstance(linear, nn.Linear):
            raise ConfigError(f"a personal head needs a linear classifier, and {name} of this backbone is none")
        # skip_init: zeros, drawing nothing from the global generator (the run's seeds stay where they were).
        head = torch.nn.utils.skip_init(
            nn.Linear, linear.in_features, linear.out_features, device=linear.weight.device, dtype=linear.weight.dtype
        )
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
        base.add_module(PERSONAL_HEAD, head)
        self.personal_head = head
        classifier.register_forward_hook(self._add_personal_logits)
        names = {id(p): n for n, p in self.module.named_parameters()}
        generic = {suffix: names[id(p)] for suffix, p in linear.named_parameters()}
        for suffix, parameter in head.named_parameters():
            key = names[id(parameter)]
            self._parameters[key] = parameter
            self._personal_head_keys[key] = generic[suffix]
        self.__dict__.pop("_saved_names", None)  # computed without the head

    @property
    def personal_head_keys(self) -> dict[str, str]:
        """The personal head's state keys, each mapped to the key of the classifier's parameter of the same role."""
        return self._personal_head_keys

    def split_logits(self, inputs: torch.Tensor, *, detach_features: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(generic, personal) logits of a batch, the classifier's and the personal head's, whose sum the model
        returns. With `detach_features`, the personal logits send no gradient back into the features."""
        assert self.personal_head is not None, "the model has no personal head"
        self._split, self._detach_features = [], detach_features
        try:
            self(inputs)
            ((generic, personal),) = self._split
        finally:
            self._split, self._detach_features = None, False
        return generic, personal

    def _add_personal_logits(self, module: nn.Module, args: tuple[Any, ...], generic: torch.Tensor) -> torch.Tensor:
        """Forward hook of the classifier: its logits plus the personal head's on the same input."""
        assert self.personal_head is not None
        features = args[0].detach() if self._detach_features else args[0]
        personal = self.personal_head(features)
        if self._split is not None:
            self._split.append((generic, personal))
        return generic + personal

    @property
    def frozen_norm_buffers(self) -> frozenset[str]:
        """The state keys of the frozen BatchNorms' running statistics (ResNets' downsample BatchNorms): in the
        state with `frozen_bn` "train", none otherwise."""
        return frozenset(self._frozen_norm_buffers)

    def state_names(self) -> list[str]:
        """The keys of `state`, in its order: trainable parameters, then buffers."""
        return [*self._parameters, *self._buffers]

    def state(self, names: Collection[str] | None = None) -> AdapterState:
        """A copy of the model's current state: trainable parameters, then buffers (`state_names`), detached; only
        the entries `names` where given (e.g. `frozen_norm_buffers`)."""
        tensors = {**self._parameters, **self._buffers}
        return {name: tensor.detach().clone() for name, tensor in tensors.items() if names is None or name in names}

    @torch.no_grad()
    def load_state(self, state: AdapterState) -> None:
        """Copy `state` into the shared model; a state whose keys are not exactly the model's is refused
        (`check_fits`): take a payload's or an upload's extra entries out first."""
        self.check_fits(state)
        for name, parameter in self._parameters.items():
            parameter.copy_(state[name])
        for name, buffer in self._buffers.items():
            buffer.copy_(state[name])

    def check_fits(self, state: AdapterState) -> None:
        """Refuse a state whose entries are not this model's (a state of another model)."""
        if state.keys() != self._parameters.keys() | self._buffers.keys():
            unknown = sorted(state.keys() - self._parameters.keys() - self._buffers.keys())[:3]
            raise WeightsError(f"adapter state does not fit this model (e.g. {unknown or 'missing keys'})")

    def train(self) -> None:
        """Training mode for adapters and trainable norms; the frozen backbone's BatchNorms keep their statistics
        unless `frozen_bn` is `train`."""
        self.module.train()
        if self.frozen_bn == "eval":
            for norm in self._frozen_norms:
                norm.eval()

    def eval(self) -> None:
        self.module.eval()

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        return logits_of(self.module(inputs))

    @property
    def weights_file(self) -> str:
        """The file in a saved directory that holds the state (the rest is the same for every client)."""
        return FULL_MODEL_FILE if self.scope == "full" else ADAPTER_WEIGHTS_FILE

    def save_pretrained(self, directory: Path, state: AdapterState) -> None:
        """PEFT layout: adapter_config.json + adapter_model.safetensors, loadable with PeftModel.from_pretrained: the
        files PEFT's own `save_pretrained` writes with `state` loaded, byte for byte, but for its empty model-card
        template (README.md), the same for every adapter: `export` writes each a filled card
        (`peradapt.commands.cards`).

        A whole trained network (scope `full`) is no adapter: it is saved as one safetensors file of the state.
        An adapter's state is left loaded in the model, as when PEFT saved it from there.
        """
        write_files(directory, self.saved_files(state))
        if self.scope != "full":
            self.load_state(state)

    def saved_files(self, state: AdapterState) -> dict[str, bytes]:
        """What `save_pretrained` writes for `state`: file name -> content."""
        if self.scope == "full":
            return {FULL_MODEL_FILE: save({k: v.detach().cpu().contiguous() for k, v in state.items()})}
        self.check_fits(state)
        # Only the weights differ between adapters of one model: they are renamed as PEFT saves them (no state is
        # loaded into the model), and the other files come from one save by PEFT, whose model card alone takes
        # ~40 ms: too long for thousands of clients.
        weights = {saved: state[name].detach().cpu().contiguous() for name, saved in self._saved_names.items()}
        files = {**self._layout_files, ADAPTER_WEIGHTS_FILE: save(weights, metadata={"format": "pt"})}
        if self._frozen_norm_buffers:
            norms = {name: state[name].detach().cpu().contiguous() for name in sorted(self._frozen_norm_buffers)}
            files[FROZEN_NORMS_FILE] = save(norms)
        return files

    @functools.cached_property
    def _saved_names(self) -> dict[str, str]:
        """State name -> name in PEFT's saved weights, for the entries PEFT saves (as `get_peft_model_state_dict`
        picks and renames them, e.g. without the adapter name; asked once, it walks every module)."""
        state = self.state()
        names = {id(tensor): name for name, tensor in state.items()}
        saved = {names[id(tensor)]: saved for saved, tensor in get_peft_model_state_dict(self.module, state).items()}
        # A personal head, no PEFT layer, keeps its own name, which `set_peft_model_state_dict` loads as it is.
        return {**saved, **{key: key for key in self._personal_head_keys}}

    @functools.cached_property
    def _layout_files(self) -> dict[str, bytes]:
        """The files PEFT's save_pretrained writes besides the weights and its model-card template: the config."""
        with tempfile.TemporaryDirectory() as scratch:
            self.module.save_pretrained(scratch)
            skipped = (ADAPTER_WEIGHTS_FILE, PEFT_CARD_FILE)
            files = {p.name: p.read_bytes() for p in Path(scratch).iterdir() if p.name not in skipped}
        # PEFT writes target_modules from a set, in an order that changes with Python's hash seed; sorted, the
        # same adapter always gives the same bytes (resumed and uninterrupted runs compare equal file by file).
        config = json.loads(files[ADAPTER_CONFIG_FILE])
        if isinstance(config.get("target_modules"), list):
            config["target_modules"] = sorted(config["target_modules"])
        files[ADAPTER_CONFIG_FILE] = json.dumps(config, indent=2, sort_keys=True).encode()
        return files

    def load_pretrained(self, directory: Path) -> AdapterState:
        """The state of an adapter saved in PEFT layout (by `save_pretrained` or any PEFT code)."""
        if self.scope == "full":
            return self._load_full(Path(directory) / FULL_MODEL_FILE)
        weights = _read_tensors(Path(directory) / ADAPTER_WEIGHTS_FILE, f"no adapter at {directory}")
        path = Path(directory) / ADAPTER_WEIGHTS_FILE
        self._check_saved_config(Path(directory) / ADAPTER_CONFIG_FILE)
        self._check_saved_weights(weights, path)  # before PEFT loads any of it: an adapter of another model
        try:
            result = set_peft_model_state_dict(self.module, weights)
        except (RuntimeError, KeyError, ValueError) as exc:  # what PEFT raises on what the check above lets through
            raise WeightsError(f"adapter {path} does not fit this backbone: {str(exc).splitlines()[0]}") from None
        own = self._parameters.keys() | (self._buffers.keys() - self._frozen_norm_buffers)
        missing = [k for k in result.missing_keys if k in own]
        if result.unexpected_keys or missing:
            example = (list(result.unexpected_keys) or missing)[:2]
            raise WeightsError(f"adapter {path} does not fit this model (e.g. {example})")
        if self._frozen_norm_buffers:
            self._load_frozen_norms(Path(directory) / FROZEN_NORMS_FILE)
        return self.state()

    def _check_saved_config(self, path: Path) -> None:
        """Refuse an adapter_config.json (`path`) that is missing, no JSON object, or describes another adapter than
        this model's: PEFT builds the adapter that loads the weights from it."""
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise WeightsError(f"no adapter at {path.parent} (missing {path.name})") from None
        except (OSError, ValueError) as exc:  # a UnicodeDecodeError is a ValueError too
            raise WeightsError(f"{path} is damaged (not a JSON file: {exc})") from None
        if not isinstance(saved, dict):
            raise WeightsError(f"{path} is damaged (not a JSON object)")
        own = json.loads(self._layout_files[ADAPTER_CONFIG_FILE])
        for key in _DESCRIBING_KEYS:
            mine, theirs = own.get(key), saved.get(key)
            if isinstance(mine, list) and isinstance(theirs, list):  # PEFT writes some from sets
                mine, theirs = sorted(map(str, mine)), sorted(map(str, theirs))
            if mine != theirs:
                raise WeightsError(
                    f"{path} describes another adapter than this model's ({key} {theirs!r}, this model's {mine!r})"
                )

    def _check_saved_weights(self, weights: dict[str, torch.Tensor], path: Path) -> None:
        """Refuse saved adapter weights (`path`) whose names or shapes are not the ones this model saves: an adapter
        of another kind, backbone or number of classes."""
        state = self.state()
        expected = {saved: tuple(state[name].shape) for name, saved in self._saved_names.items()}
        unknown = sorted(weights.keys() - expected.keys())
        missing = sorted(expected.keys() - weights.keys())
        if unknown or missing:
            example = f"{unknown[0]!r} unknown" if unknown else f"{missing[0]!r} missing"
            raise WeightsError(
                f"adapter {path} does not fit this model: it is an adapter of another kind or backbone ({example}, "
                f"{len(weights)} tensors where this model's adapter has {len(expected)})"
            )
        for name, shape in expected.items():
            if tuple(weights[name].shape) != shape:
                raise WeightsError(
                    f"adapter {path} does not fit this model: {name} has shape {list(weights[name].shape)}, this "
                    f"model's {list(shape)} (an adapter of another backbone or number of classes)"
                )

    @torch.no_grad()
    def _load_frozen_norms(self, path: Path) -> None:
        statistics = _read_tensors(path, f"{path.parent} lacks what a --frozen-bn train adapter needs")
        if statistics.keys() != self._frozen_norm_buffers:
            raise WeightsError(f"{path} holds statistics of other BatchNorms than this model's")
        for name in self._frozen_norm_buffers:
            self._buffers[name].copy_(statistics[name])

    def _load_full(self, path: Path) -> AdapterState:
        self.load_state(_read_tensors(path, f"no trained model at {path.parent}", device=str(self.device)))
        return self.state()


def logits_of(outputs: Any) -> torch.Tensor:
    """The logits of a network's answer: transformers models answer with a ModelOutput, timm's with the tensor."""
    return outputs if isinstance(outputs, torch.Tensor) else outputs.logits


def _read_tensors(path: Path, missing: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of safetensors file `path`; a missing or unreadable file is a WeightsError (`missing` says what
    its absence means)."""
    if not path.is_file():
        raise WeightsError(f"{missing} (missing {path.name})")
    try:
        return load_file(str(path), device=device)
    except (SafetensorError, OSError) as exc:
        raise WeightsError(f"cannot read {path} ({exc})") from None


def _is_added(name: str) -> bool:
    """Whether a base-model tensor was added to the backbone (PEFT's LoRA factor or a head's trainable copy, or a
    personal head), not the backbone's own."""
    return "lora_" in name or "modules_to_save" in name or name.split(".", 1)[0] == PERSONAL_HEAD


def _active_linear(classifier: nn.Module) -> nn.Module:
    """The classifier module that computes the logits: PEFT's trainable copy where PEFT wraps the head."""
    copies = getattr(classifier, "modules_to_save", None)
    return next(iter(copies.values())) if isinstance(copies, nn.ModuleDict) and len(copies) else classifier


def write_files(directory: Path, files: dict[str, bytes]) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (directory / name).write_bytes(content)


def inject_adapters(
    backbone: nn.Module,
    kind: str,
    *,
    dropout: float,
    lora_rank: int,
    scope: str = "adapter",
    frozen_bn: str = "eval",
) -> AdaptedModel:
    """Wrap a frozen backbone with PEFT adapters of `kind` (residual: PerAda's; lora: PEFT LoRA).

    Scope `full` trains the whole network as well (the paper's full-model baselines); kind `none` is only
    possible there and leaves the network as it is. `frozen_bn`: see `AdaptedModel`.
    """
    if scope not in SCOPES:
        raise ConfigError(f"unknown --scope '{scope}': use adapter or full")
    if kind == "none":
        if scope != "full":
            raise ConfigError("--adapter none trains nothing with --scope adapter: use --scope full")
        backbone.requires_grad_(True)
        return AdaptedModel(backbone, kind, scope, frozen_bn)
    model = get_peft_model(backbone, _peft_config(backbone, kind, dropout, lora_rank))
    if scope == "full":
        for name, parameter in model.named_parameters():
            # PEFT keeps an unused copy of every module it trains a replacement of: that copy stays frozen.
            parameter.requires_grad_("original_module" not in name)
    return AdaptedModel(model, kind, scope, frozen_bn)


def _peft_config(backbone: nn.Module, kind: str, dropout: float, lora_rank: int) -> LoraConfig:
    head = classifier_name(backbone)
    block_convs = _basic_block_convs(backbone)
    if kind == "residual":
        if is_vit(backbone):  # the bottleneck adapter on every block's MLP output (adapters/vit.py)
            targets = mlp_outputs(backbone)
            _check_rank(backbone, targets, lora_rank)
            return LoraConfig(
                target_modules=targets,
                modules_to_save=[*block_layer_norms(backbone), head],
                r=lora_rank,
                lora_dropout=dropout,
                init_lora_weights=RESIDUAL_INIT,
            )
        if not block_convs:
            raise ConfigError(
                f"residual adapters need a basic-block ResNet (resnet18, resnet34, resnet10t, ...) or a ViT, "
                f"not {type(backbone).__name__}: use --adapter lora"
            )
        return LoraConfig(
            target_modules=block_convs,
            modules_to_save=["bn1", "bn2", head],
            lora_dropout=dropout,
            init_lora_weights=RESIDUAL_INIT,
        )
    if kind == "lora":
        targets = _lora_targets(backbone, block_convs, head)
        _check_rank(backbone, targets, lora_rank)
        return LoraConfig(
            target_modules=targets,
            modules_to_save=[head],
            r=lora_rank,
            lora_alpha=lora_rank,
            lora_dropout=dropout,
        )
    raise ConfigError(f"unknown --adapter '{kind}': use one of {', '.join(ADAPTER_KINDS)}")


def _check_rank(backbone: nn.Module, targets: list[str], rank: int) -> None:
    """A rank (or bottleneck width) above every adapted layer's width adds parameters and memory, no capacity."""
    modules = dict(backbone.named_modules())
    widths = [
        max(
            getattr(module, "in_features", 0),
            getattr(module, "out_features", 0),
            getattr(module, "in_channels", 0),
            getattr(module, "out_channels", 0),
        )
        for module in (modules[name] for name in targets if name in modules)
    ]
    if widths and rank > max(widths):
        raise ConfigError(
            f"--lora-rank {rank} is above the width of every layer it adapts (at most {max(widths)}): give at most "
            f"{max(widths)}"
        )


def _lora_targets(backbone: nn.Module, block_convs: list[str], head: str) -> list[str]:
    """ResNets: the basic blocks' convolutions; ViTs: the attention and MLP projections; other networks: every
    convolution and linear layer. Never the head, which trains whole."""
    if block_convs:
        return block_convs
    if is_vit(backbone):
        return linear_layers(backbone, head)
    return [n for n, m in backbone.named_modules() if isinstance(m, nn.Conv2d | nn.Linear) and n != head]


def _basic_block_convs(backbone: nn.Module) -> list[str]:
    """Names of conv1/conv2 of every basic block, where PerAda places its adapters."""
    names = []
    for name, module in backbone.named_modules():
        if isinstance(module, BasicBlock):
            names += [f"{name}.conv1", f"{name}.conv2"]
    return names


def default_adapter_kind(backbone_name: str) -> str:
    return "residual" if re.match(r"resnet", backbone_name) else "lora"
