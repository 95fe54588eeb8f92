"""Model cards of an export: a README.md with YAML front matter (the Hugging Face Hub's model-card format) for
every exported adapter and one for the whole federation.

`RunCards` reads what a finished run recorded, once: its config, what the settings resolved to (config.json's
"resolved": adapter kind, scope, backbone weights and their fingerprint) and its final evaluation (report.json).
`RunCards.adapter(client)` renders the card of one client's personalized adapter (`client=None`: the global
adapter) with its own scores, `RunCards.federation(...)` the card of the export. A card says what the adapter is,
what it was trained on and how, how well it did, and how to load it; the loading recipe is the one
`tests/test_model_cards.py` executes.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from huggingface_hub import EvalResult, ModelCardData

from peradapt.backbones import fixed_image_size
from peradapt.backbones.hf import HF_PREFIX, is_hf
from peradapt.config import TrainConfig
from peradapt.data import hfdata
from peradapt.data.sources import source_kind
from peradapt.errors import ConfigError
from peradapt.progress import counted
from peradapt.rundir.records import Privacy, Report, Resolved, Stats

CARD_FILE = "README.md"
TAGS = ("peradapt", "federated-learning", "personalization")
ADAPTER_TAGS = {"residual": "residual-adapter", "lora": "lora", "none": "full-model"}
FEDERATION_ROWS = 100  # a federation card lists this many clients' scores; each client's own card has its own
METRIC_LABELS = {"accuracy": "accuracy", "auc": "AUC"}
METRIC_TYPES = {"accuracy": "accuracy", "auc": "roc_auc"}  # the Hub's names of the metrics, for model-index
TEST_DATA = {  # what the test splits of a model-index are
    "local-test": "each client's own test split",
    "global-test": "all clients' test data",
}
# The Hugging Face Hub datasets that built-in sources are (a card's `datasets`); others are named where they come
# from the Hub (`hf:NAME`), else not at all.
HUB_DATASETS = {
    "fmnist": "zalando-datasets/fashion_mnist",
    "cifar10": "uoft-cs/cifar10",
    "cifar100": "uoft-cs/cifar100",
    "svhn": "ufldl-stanford/svhn",
}
# A license as the Hub's metadata takes it: its identifier (apache-2.0, mit, cc-by-nc-4.0, other, ...).
_LICENSE_ID = re.compile(r"[a-z0-9][a-z0-9.+-]*")


@dataclass(frozen=True)
class HubTarget:
    """Where `peradapt export --push-to-hub` uploads an export: the repository and the clients it holds."""

    repo_id: str
    clients: tuple[int, ...]


class RunCards:
    """The cards of one finished run's export (see the module docstring)."""

    def __init__(
        self,
        config: TrainConfig,
        resolved: Resolved,
        report: Report,
        hub: HubTarget | None = None,
        *,
        license: str | None = None,
        merged: bool = False,
    ) -> None:
        """`license`: the license the cards declare (`export --license`); None: the backbone weights' own where
        their Hub config names one, else none. `merged`: the export holds merged models (`export --merge`)."""
        self.config, self.resolved, self.report, self.hub = config, resolved, report, hub
        self.merged = merged
        self.backbone = config.backbone.backbone
        self.kind = resolved.adapter
        self.scope = resolved.scope
        self.method, self.metric_key = report.method, report.metric
        self.metric = METRIC_LABELS.get(self.metric_key, self.metric_key)
        self.clients: list[int] = report.clients
        self.position = {client: index for index, client in enumerate(self.clients)}
        personal_global = report.personalized.global_test
        sampled = personal_global.clients or self.clients  # a large federation: a sample of the clients
        self.personal_global = dict(zip(sampled, personal_global.per_client, strict=False))
        self.hub_model, hub_license = _hub_origin(self.backbone, config.backbone.weights, resolved.weights)
        self.license = check_license(license) if license is not None else hub_license
        self.data, self.hub_dataset = public_data(report.data)
        self.second_head = _has_second_head(self.method)
        # timm's registry is slow to ask (thousands of names): asked once for every card of the run
        self.native_size = None if is_hf(self.backbone) else fixed_image_size(self.backbone)
        self.peradapt_backbone = not is_hf(self.backbone) and _registered_by_peradapt(self.backbone)
        self.metadata = self._metadata()

    # ------------------------------------------------------------------------------------------------ the cards

    def adapter(self, client: int | None) -> str:
        """The card of client `client`'s personalized adapter, or of the global adapter (`client=None`)."""
        noun, data = self._model_noun(), self.data
        if client is None:
            title = f"Global {noun} of a {self.method} federation on {data}"
            what = f"The global {noun} of {self._federation()}: the model the server holds after the last round."
            whose = "the global model"
        else:
            title = f"Client {client}: personalized {noun} ({self.method} on {data})"
            what = (
                f"The personalized {noun} of client {client} in {self._federation()}: the model this client is "
                "evaluated and exported with."
            )
            whose = f"client {client}'s personalized model"
        sections = [
            self._front_matter(title, self._scores(client)),
            f"# {title}",
            what,
            self._facts_table(whose, client),
            "## Results",
            self._results(client),
            "## Use it",
            self._usage("global" if client is None else f"clients/{client}", own_card=True),
        ]
        return "\n\n".join(sections) + "\n"

    def federation(self) -> str:
        """The card of the whole export: the federation, its scores per client and what the export holds."""
        noun, held_out = self._model_noun(), self.report.held_out_clients or []
        contents = [
            f"- `global/`: the global {noun}, with its card;",
            f"- `clients/<id>/`: each client's personalized {noun}, with its card "
            f"({counted(len(self.clients), 'client')}: {id_ranges(self.clients)});",
            f"- {self._backbone_files()}: the backbone and its input normalization."
            if not self.merged
            else f"- each directory holds a whole {self._library()} model, the adapters merged into the backbone.",
        ]
        if self.hub is not None:
            contents.append(
                f"\nThe Hugging Face repository [`{self.hub.repo_id}`](https://huggingface.co/{self.hub.repo_id}) "
                f"holds the backbone, the global {noun} and the personalized {noun}s of "
                f"{counted(len(self.hub.clients), 'client')} ({id_ranges(list(self.hub.clients))})."
            )
        if held_out:
            contents.append(
                f"\n{counted(len(held_out), 'client')} ({id_ranges(held_out)}) were held out of training "
                "(`--holdout-clients`): they have no adapter here; `peradapt personalize --run RUN --new-client ID` "
                "trains one from the global model."
            )
        first = self.hub.clients[0] if self.hub is not None and self.hub.clients else self.clients[0]
        title = f"{self.method} on {self.data}: a federation of {counted(len(self.clients), 'client')}"
        sections = [
            self._front_matter(title, self._scores("federation")),
            f"# {title}",
            f"{_sentence(self._federation())}: the global {noun} and every client's personalized {noun}.",
            self._facts_table("every client's personalized model and the global model, each", None),
            "## Contents",
            "\n".join(contents),
            "## Results",
            self._summary(),
            self._client_table(),
            "## Use it",
            self._usage(f"clients/{first}"),
            f"Another client's {noun} (`clients/<id>`) or the global one (`global`) loads the same way; each has its "
            "own card.",
        ]
        return "\n\n".join(sections) + "\n"

    # ------------------------------------------------------------------------------------------------ parts

    def _metadata(self) -> dict[str, Any]:
        """The Hub's model-card metadata every card of the run shares (each adds its own `model-index`)."""
        # PEFT layout (adapter_config.json + adapter_model.safetensors), else one state file of the whole network
        library = "peft" if self.scope != "full" and not self.merged else self._library()
        metadata: dict[str, Any] = {"library_name": library}
        if self.hub_model is not None:
            metadata["base_model"] = self.hub_model
        if self.license is not None:
            metadata["license"] = self.license
        if self.hub_dataset is not None:
            metadata["datasets"] = [self.hub_dataset]
        metadata["pipeline_tag"] = "image-classification"
        metadata["tags"] = [*TAGS, self.method, ADAPTER_TAGS.get(self.kind, self.kind), *(["merged"] * self.merged)]
        return metadata

    def _library(self) -> str:
        return "transformers" if is_hf(self.backbone) else "timm"

    def _front_matter(self, name: str, scores: list[tuple[str, str, float | None]]) -> str:
        """YAML front matter: the shared metadata and a `model-index` of `scores` (which model, on which test data,
        the value), as `huggingface_hub.ModelCardData` writes them (the Hub shows them as evaluation results). The
        test data is the split (`local-test` or `global-test`), so that the Hub, which groups results by dataset and
        split, keeps them apart. Undefined scores (no test images) are left out."""
        results = [
            EvalResult(
                task_type="image-classification",
                dataset_type=self.hub_dataset or self.data,
                dataset_name=f"{self.data}, {TEST_DATA[split]}",
                dataset_split=split,
                metric_type=METRIC_TYPES.get(self.metric_key, self.metric_key),
                metric_name=f"{who}, {self.metric} on {split}",
                metric_value=round(100 * value, 2),
            )
            for who, split, value in scores
            if value is not None and not math.isnan(value)
        ]
        card_data = ModelCardData(**self.metadata, model_name=name, eval_results=results or None)
        return "---\n" + card_data.to_yaml() + "\n---"

    def _scores(self, client: int | str | None) -> list[tuple[str, str, float | None]]:
        """The scores of a card's model-index: (model, test split, value) of `client`'s personalized model, of the
        global model (None) or of the whole federation ("federation"); on local-test, a mean over clients but for
        one client's own."""
        personal, global_ = self.report.personalized, self.report.global_
        if client == "federation":
            return [
                ("personalized models (mean over clients)", "local-test", personal.local_test.mean),
                ("global model", "global-test", global_.global_test),
            ]
        if client is None:
            return [
                ("global model", "global-test", global_.global_test),
                ("global model (mean over clients)", "local-test", global_.local_test.mean),
            ]
        assert isinstance(client, int)
        local = _at(personal.local_test.per_client, self.position[client])
        return [
            (f"client {client}'s personalized model", "local-test", local),
            (f"client {client}'s personalized model", "global-test", self.personal_global.get(client)),
        ]

    def _model_noun(self) -> str:
        return "model" if self.scope == "full" or self.merged else "adapter"

    def _federation(self) -> str:
        return (
            f"a simulated federation of {counted(len(self.clients), 'client')} trained by peradapt with "
            f"`{self.method}` for {counted(self.report.rounds, 'round')}"
        )

    def _facts_table(self, whose: str, client: int | None) -> str:
        rows = [
            ("model", f"{whose}: {self._model_description()}"),
            ("method", f"`{self.method}`: {_method_summary(self.method)}"),
            ("backbone", self._backbone_description()),
            ("backbone weights", self._weights_description()),
            ("data", self._data_description()),
            ("partition", f"`{self.config.data.partition}` over {counted(self.config.federation.clients, 'client')}"),
            ("training", self._training_description()),
        ]
        privacy = self.report.privacy
        if privacy is not None:
            rows.append(("differential privacy", self._privacy_description(privacy, client)))
        versions = self.resolved.versions
        rows.append(("software", ", ".join(f"{name} {version}" for name, version in versions.items())))
        return "| | |\n|---|---|\n" + "\n".join(f"| {name} | {_cell(value)} |" for name, value in rows)

    def _model_description(self) -> str:
        trainable, total = self.resolved.trainable_parameters, self.resolved.backbone_parameters
        if self.kind == "none":
            kind = "the whole network, trained; no adapter"
        elif self.kind == "residual":
            kind = (
                "residual bottleneck adapters (Houlsby et al. 2019) on every block's MLP output, with the blocks' "
                "LayerNorms and the head"
                if is_hf(self.backbone) or self.native_size is not None  # a ViT: a fixed input size
                else "residual adapters (PerAda; Rebuffi et al. 2017 series adapters: `y + conv1x1(dropout(BN(y)))` "
                "after conv1 and conv2 of every basic block), with the BatchNorms and the head"
            )
            if not self.merged:
                kind += "; a custom PEFT layer (built on PEFT's LoRA machinery) that peradapt registers with PEFT"
        else:
            kind = f"PEFT LoRA of rank {self.config.adapter.lora_rank} on the backbone's layers, and the head"
        if self.scope == "full" and self.kind != "none":
            kind += "; the whole network under them trains too (`--scope full`)"
        if self.second_head:
            kind += "; plus a personal linear head whose logits are added to the classifier's"
        kind += f" ({trainable:,} trainable parameters; the backbone has {total:,})"
        if self.merged:
            kind += (
                f"; **merged**: folded into the backbone's weights (`peradapt export --merge`), a plain "
                f"{self._library()} model with the same outputs in eval mode, which loads without peradapt"
            )
        return kind

    def _backbone_description(self) -> str:
        library = "transformers" if is_hf(self.backbone) else "timm"
        role = "trained whole from these weights" if self.scope == "full" else "frozen"
        return f"`{public_backbone(self.backbone).removeprefix(HF_PREFIX)}` ({library}), {role}"

    def _weights_description(self) -> str:
        source = self.resolved.weights
        described = _described_source(self.resolved.backbone_sha256)
        parts = []
        if self.hub_model is not None:
            parts.append(f"[{self.hub_model}](https://huggingface.co/{self.hub_model})")
        if described and described != source:
            parts.append(described)
        public = public_weights(source)
        if public and self.hub_model is None:
            parts.append(f"from `{public}`")
        fingerprint = self.resolved.backbone_sha256
        parts.append(f"fingerprint (SHA-256 of its tensors but the head, and its normalization) `{fingerprint}`")
        return "; ".join(parts)

    def _data_description(self) -> str:
        resolved = self.resolved
        shape = f"{resolved.channels}-channel {resolved.image_size}×{resolved.image_size} px images"
        names = ", ".join(resolved.classes)
        return f"`{self.data}`: {shape}, {resolved.num_classes} classes; classes, in the order of the logits: {names}"

    def _training_description(self) -> str:
        fed = self.config.federation
        text = (
            f"{counted(self.report.rounds, 'round')}, {fed.clients_per_round} of "
            f"{len(self.clients)} clients sampled per round, seed {self.report.seed}"
        )
        if fed.holdout_clients:
            text += f"; {counted(fed.holdout_clients, 'client')} held out (not trained, not exported)"
        return text

    def _privacy_description(self, privacy: Privacy, client: int | None) -> str:
        mechanism = (
            f"DP-SGD on every client's data (noise multiplier {privacy.noise_multiplier}, clipping norm "
            f"{privacy.max_grad_norm}, {privacy.accountant} accountant)"
        )
        epsilon, delta = privacy.epsilon, privacy.delta
        if client is None:
            spent = (
                f"ε per client {epsilon.mean:.2f} ± {epsilon.std:.2f}, at most {epsilon.max:.2f}, at "
                f"δ = {delta:g}; the global model is computed from the clients' DP-trained updates"
            )
        else:
            spent = f"ε = {epsilon.per_client[self.position[client]]:.2f} for this client's data at δ = {delta:g}"
        return f"{mechanism}: {spent}"

    def _results(self, client: int | None) -> str:
        label = self.metric
        rows: list[tuple[str, str, str]] = []
        personal, global_ = self.report.personalized, self.report.global_
        if client is None:
            rows.append(("this global model", "all clients' test data (global-test)", _score(global_.global_test)))
            rows.append(
                (
                    "this global model",
                    "each client's own test split (local-test), mean ± std over clients",
                    _mean_std(global_.local_test),
                )
            )
            rows.append(
                (
                    "the personalized models",
                    "each client's own test split (local-test), mean ± std over clients",
                    _mean_std(personal.local_test),
                )
            )
        else:
            index = self.position[client]
            rows.append(
                (
                    "this personalized model",
                    f"client {client}'s test split (local-test)",
                    _score(_at(personal.local_test.per_client, index)),
                )
            )
            if client in self.personal_global:
                rows.append(
                    (
                        "this personalized model",
                        "all clients' test data (global-test)",
                        _score(self.personal_global[client]),
                    )
                )
            rows.append(
                (
                    "the global model",
                    f"client {client}'s test split (local-test)",
                    _score(_at(global_.local_test.per_client, index)),
                )
            )
            rows.append(
                (
                    "every client's personalized model",
                    "its own test split (local-test), mean ± std over clients",
                    _mean_std(personal.local_test),
                )
            )
        table = f"| model | test data | {label} |\n|---|---|---|\n" + "\n".join(
            f"| {who} | {data} | {value} |" for who, data, value in rows
        )
        return (
            f"{table}\n\nThe final round's models, as exported (the run's report.json; no round selected on test "
            "data). n/a: no test images."
        )

    def _summary(self) -> str:
        personal, global_ = self.report.personalized, self.report.global_
        rows = [
            ("personalized", "local-test (each client's own test split)", _mean_std(personal.local_test)),
            ("personalized", "global-test (all clients' test data)", _mean_std(personal.global_test)),
            ("global", "local-test", _mean_std(global_.local_test)),
            ("global", "global-test", _score(global_.global_test)),
        ]
        return f"| model | test data | {self.metric} (mean ± std over clients) |\n|---|---|---|\n" + "\n".join(
            f"| {who} | {data} | {value} |" for who, data, value in rows
        )

    def _client_table(self) -> str:
        privacy = self.report.privacy
        columns = ["client", "personalized, local-test", "personalized, global-test", "global, local-test"]
        if privacy is not None:
            columns.append("ε")
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        personal, global_ = self.report.personalized, self.report.global_
        for index, client in enumerate(self.clients[:FEDERATION_ROWS]):
            cells = [
                str(client),
                _score(_at(personal.local_test.per_client, index)),
                _score(self.personal_global.get(client)) if client in self.personal_global else "-",
                _score(_at(global_.local_test.per_client, index)),
            ]
            if privacy is not None:
                cells.append(f"{_at(privacy.epsilon.per_client, index):.2f}")
            lines.append("| " + " | ".join(cells) + " |")
        more = len(self.clients) - FEDERATION_ROWS
        note = f"\n\n… and {more:,} more clients: each client's card has its own scores." if more > 0 else ""
        return f"Per client ({self.metric}):\n\n" + "\n".join(lines) + note

    def _backbone_files(self) -> str:
        return "`backbone/` + `backbone.json`" if is_hf(self.backbone) else "`backbone.safetensors` + `backbone.json`"

    # ------------------------------------------------------------------------------------------------ loading

    def _needs_peradapt(self) -> str:
        """Why loading this model needs peradapt ("": plain timm/transformers and PEFT load it)."""
        registered = []
        if self.kind == "residual" and not self._peradapt_api():
            registered.append("the residual adapter (a custom PEFT layer) with PEFT")
        if self.peradapt_backbone:
            registered.append(f"{self.backbone} with timm")
        reasons = ["`peradapt.inject_adapters` builds the model this file holds"] if self._peradapt_api() else []
        if registered:
            reasons.append("importing it registers " + " and ".join(registered))
        return "; ".join(reasons)

    def _peradapt_api(self) -> bool:
        """Whether the model needs peradapt's `AdaptedModel` to load: a second (personal) head, or adapters that
        train with the whole network, saved as one state file without a PEFT adapter config."""
        return self.second_head or (self.scope == "full" and self.kind != "none")

    def _usage(self, target: str, *, own_card: bool = False) -> str:
        """How to load the model in `target` (a directory of the export) and feed it: code, then a note. `own_card`:
        for the card in `target` (a merged model's code then runs from inside its directory)."""
        if self.merged:
            return self._merged_usage(target, own_card)
        hf_backbone, reasons = is_hf(self.backbone), self._needs_peradapt()
        channels, size = self.resolved.channels, self.resolved.image_size
        standard = ["import json", *(["from pathlib import Path"] if self._peradapt_api() else [])]
        third_party = ["import torch"]
        if self.hub is not None:
            third_party.append("from huggingface_hub import snapshot_download")
        if not self._peradapt_api() and self.scope != "full":
            third_party.append("import peft")
        if not hf_backbone or self.scope == "full":
            third_party.append("from safetensors.torch import load_file")
        third_party.append("from transformers import AutoModelForImageClassification" if hf_backbone else "import timm")
        lines = [*standard, "", *sorted(third_party, key=_import_order)]
        if reasons:
            lines += ["", f"# pip install peradapt: {reasons}", "import peradapt"]
        lines.append("")
        if self.hub is not None:
            patterns = json.dumps(["backbone*", f"{target}/*"])
            lines.append(f"root = snapshot_download({json.dumps(self.hub.repo_id)}, allow_patterns={patterns})")
        else:
            lines.append('root = "."  # the export\'s directory (holding backbone.json)')
        if hf_backbone:
            lines.append('backbone = AutoModelForImageClassification.from_pretrained(f"{root}/backbone")')
        else:
            arguments = [json.dumps(self.backbone), f"num_classes={self.resolved.num_classes}"]
            arguments.append(f"in_chans={channels}")
            if self.native_size is not None and size not in (None, self.native_size):  # a ViT made for `size`
                arguments.append(f"img_size={size}")
            lines += [
                f"backbone = timm.create_model({', '.join(arguments)})",
                'backbone.load_state_dict(load_file(f"{root}/backbone.safetensors"))',
            ]
        lines += self._model_lines(target)
        lines += ["", 'normalization = json.load(open(f"{root}/backbone.json"))', *self._preprocessing("normalization")]
        lines.append(f"#     logits = model(preprocess(images)){'.logits' if self._returns_output() else ''}")
        return self._code_and_note(lines, "`backbone.json`")

    def _merged_usage(self, target: str, own_card: bool) -> str:
        """How to load the merged model in `target` with timm or transformers alone, and feed it: from inside its
        directory for its own card (`own_card`), else from the export's directory; from the Hub when pushed."""
        third_party = ["import torch"]
        if self.hub is not None:
            third_party.append("from huggingface_hub import snapshot_download")
        if is_hf(self.backbone):
            third_party.append("from transformers import AutoImageProcessor, AutoModelForImageClassification")
        else:
            third_party += ["import timm", "from safetensors.torch import load_file"]
        lines = [*([] if is_hf(self.backbone) else ["import json", ""]), *sorted(third_party, key=_import_order), ""]
        if self.hub is not None:
            patterns = json.dumps([f"{target}/*"])
            lines.append(
                f'root = snapshot_download({json.dumps(self.hub.repo_id)}, allow_patterns={patterns}) + "/{target}"'
            )
        else:
            where = "." if own_card else target
            lines.append(f"root = {json.dumps(where)}  # the model's directory (holding config.json)")
        if is_hf(self.backbone):
            lines += [
                "processor = AutoImageProcessor.from_pretrained(root)",
                "model = AutoModelForImageClassification.from_pretrained(root).eval()",
                "",
                "# with torch.no_grad():",
                '#     logits = model(**processor(images=pil_images, return_tensors="pt")).logits',
                "# model.config.id2label[i] names class i",
            ]
            if self.resolved.channels == 3:
                lines += ['# or: transformers.pipeline("image-classification", model=root)(pil_image)']
            note = (
                "`preprocessor_config.json` resizes images to the model's square (bilinear), scales the pixels to "
                "[0, 1] and normalizes them with the run's mean and std, as peradapt did in training and evaluation."
            )
            return f"```python\n{chr(10).join(lines)}\n```\n\n{note}"
        lines += [
            'config = json.load(open(f"{root}/config.json"))',
            'model = timm.create_model(config["architecture"], **config["model_args"])',
            'model.load_state_dict(load_file(f"{root}/model.safetensors"))',
            "model.eval()",
            '# timm can also read the directory itself: timm.create_model(f"local-dir:{root}", pretrained=True)',
            'classes = config["label_names"]  # classes[i] names logit i',
            *self._preprocessing('config["pretrained_cfg"]'),
            "#     logits = model(preprocess(images))",
        ]
        return self._code_and_note(lines, "`config.json`")

    def _preprocessing(self, statistics: str) -> list[str]:
        """Code: `mean` and `std` from the dict expression `statistics`, and `preprocess`, as peradapt feeds its
        models; it ends with a commented call, which the caller completes."""
        channels, size = self.resolved.channels, self.resolved.image_size
        return [
            f'mean = torch.tensor({statistics}["mean"]).view(1, -1, 1, 1)',
            f'std = torch.tensor({statistics}["std"]).view(1, -1, 1, 1)',
            "",
            "",
            "def preprocess(images: torch.Tensor) -> torch.Tensor:",
            f'    """uint8 images, N × {channels} × H × W, as the model takes them: {size} × {size} px, normalized."""',
            "    pixels = images.float()",
            f"    if pixels.shape[-2:] != ({size}, {size}):",
            f'        pixels = torch.nn.functional.interpolate(pixels, size=({size}, {size}), mode="bilinear", '
            "antialias=True)",
            "    return (pixels / 255 - mean) / std",
            "",
            "",
            "# with torch.no_grad():",
        ]

    def _code_and_note(self, lines: list[str], statistics_file: str) -> str:
        channels, size = self.resolved.channels, self.resolved.image_size
        note = (
            f"The model takes {channels}-channel {size}×{size} px images: `preprocess` resizes others (bilinear, "
            "antialiased), scales the pixels to [0, 1] and normalizes them with the mean and std in "
            f"{statistics_file}, as peradapt did in training and evaluation."
        )
        return f"```python\n{chr(10).join(lines)}\n```\n\n{note}"

    def _returns_output(self) -> bool:
        """Whether the loaded model answers with a transformers ModelOutput (peradapt's model gives logits)."""
        return is_hf(self.backbone) and not self._peradapt_api()

    def _model_lines(self, target: str) -> list[str]:
        directory = f'f"{{root}}/{target}"'
        if self._peradapt_api():
            adapter = self.config.adapter
            lines = [
                "# peradapt's model: the backbone with this run's adapters, the personal head and loading rules",
                f"model = peradapt.inject_adapters(backbone, {json.dumps(self.kind)}, "
                f"dropout={adapter.adapter_dropout!r}, lora_rank={adapter.lora_rank!r}, "
                f"scope={json.dumps(self.scope)}, frozen_bn={json.dumps(self.config.method.frozen_bn)})",
            ]
            if self.second_head:
                lines.append("model.add_personal_head()  # the client's personal linear head, added to the logits")
            return [*lines, f"model.load_pretrained(Path({directory}))", "model.eval()"]
        if self.scope == "full":
            if is_hf(self.backbone):  # the state holds the trained tensors; the rest is the backbone's own
                return [
                    f'backbone.load_state_dict(load_file(f"{{root}}/{target}/model.safetensors"), strict=False)',
                    "model = backbone.eval()",
                ]
            return [
                f'backbone.load_state_dict(load_file(f"{{root}}/{target}/model.safetensors"))',
                "model = backbone.eval()",
            ]
        lines = [f"model = peft.PeftModel.from_pretrained(backbone, {directory}).eval()"]
        if self.config.method.frozen_bn == "train":
            statistics = f'load_file(f"{{root}}/{target}/frozen_bn_statistics.safetensors")'
            lines += [
                "# --frozen-bn train: the frozen BatchNorms' running statistics after this model's training",
                f"model.load_state_dict({statistics}, strict=False)",
            ]
        return lines


# ---------------------------------------------------------------------------------------------------- helpers


def _import_order(line: str) -> tuple[bool, str]:
    """isort's order of third-party imports: `import x` lines, then `from x import y`, each by module."""
    return line.startswith("from"), line.split()[1]


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _at(values: list[float], index: int) -> float | None:
    return values[index] if index < len(values) else None


def _score(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{100 * value:.2f}%"


def _mean_std(stats: Stats) -> str:
    if math.isnan(stats.mean):
        return "n/a"
    return f"{100 * stats.mean:.2f} ± {100 * stats.std:.2f}%"


def id_ranges(ids: list[int]) -> str:
    """`0-3, 7, 9-10`: sorted ids with runs of consecutive ones collapsed."""
    ranges: list[list[int]] = []
    for client in sorted(ids):
        if ranges and client == ranges[-1][1] + 1:
            ranges[-1][1] = client
        else:
            ranges.append([client, client])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def public_data(spec: str) -> tuple[str, str | None]:
    """How an export names data source `spec` without a path of the machine it ran on (a folder by its name), and
    the Hugging Face Hub dataset it is, where known."""
    kind = source_kind(spec)
    if kind == spec:
        return spec, HUB_DATASETS.get(spec)
    rest = spec.removeprefix(f"{kind}:")
    if kind == "hf" and not (Path(rest).expanduser().exists() or hfdata.looks_like_path(rest)):
        return rest, rest.partition(":")[0]  # a Hub dataset (NAME or NAME:CONFIG)
    name = Path(rest.rstrip("/")).expanduser().name or "data"
    return (f"{name} (an image folder)" if kind == "imagefolder" else f"{name} (a local Hugging Face dataset)"), None


def public_backbone(name: str) -> str:
    """Backbone `name` without a path of the machine: a timm name or a Hub model (`hf:ID`) as it is, a local
    transformers directory (`hf:PATH`) by its name."""
    if not is_hf(name):
        return name
    spec = name.removeprefix(HF_PREFIX)
    if Path(spec).expanduser().is_dir() or hfdata.looks_like_path(spec):
        return HF_PREFIX + (Path(spec.rstrip("/")).name or "model")
    return name


def public_weights(source: str | None) -> str | None:
    """Where backbone weights came from, without a path of the machine: a Hub model or URL as it is, a local file
    or directory by its name."""
    if not source:
        return None
    if source.startswith("Hugging Face Hub "):
        return source.split(" (", 1)[0]  # without "(cached file PATH)"
    if urlparse(source).scheme in ("http", "https"):
        return source
    return Path(source).name


def check_license(license: str) -> str:
    """`export --license`: a license identifier as the Hub's metadata takes it."""
    if not _LICENSE_ID.fullmatch(license):
        raise ConfigError(
            f"--license {license!r}: give a license identifier as the Hugging Face Hub lists them, e.g. apache-2.0, "
            "mit, cc-by-4.0, cc-by-nc-4.0 or other"
        )
    return license


def _hub_origin(backbone: str, weights_flag: str | None, source: str | None) -> tuple[str | None, str | None]:
    """The Hub model the backbone's weights are (`base_model`), and its license where its config says: timm's
    published weights loaded from the Hub, or a transformers model from the Hugging Face cache. Weights from a file
    (`peradapt pretrain`, `--weights`, a `hf:` directory) or a URL have none."""
    if weights_flag is not None or not source:
        return None, None
    if is_hf(backbone):
        repo = backbone.removeprefix(HF_PREFIX)
        cached = "models--" + repo.replace("/", "--")
        return (repo, None) if repo.count("/") == 1 and cached in source else (None, None)
    if not source.startswith("Hugging Face Hub "):
        return None, None
    from timm.models import get_pretrained_cfg

    config = get_pretrained_cfg(backbone)
    if config is None or not config.hf_hub_id:
        return None, None
    return config.hf_hub_id.partition("@")[0], getattr(config, "license", None) or None


@functools.lru_cache(maxsize=8)
def _described_source(fingerprint: str | None) -> str | None:
    """What the description beside the run's pinned weights says of where they came from (e.g. `peradapt pretrain
    on fmnist (…)`), if this machine has it."""
    if not fingerprint:
        return None
    from peradapt.backbones import pinned_weights_path

    try:
        source = json.loads(pinned_weights_path(fingerprint).with_suffix(".json").read_text(encoding="utf-8"))
        return str(source["source"]) if isinstance(source, dict) and source.get("source") else None
    except (OSError, ValueError):
        return None


def _registered_by_peradapt(backbone: str) -> bool:
    """Whether timm knows `backbone` only once peradapt is imported (the narrow ResNets, the tiny ViTs)."""
    from timm.models import model_entrypoint, split_model_name_tag

    try:
        return model_entrypoint(split_model_name_tag(backbone)[0]).__module__.startswith("peradapt")
    except RuntimeError:  # unknown to timm
        return False


def _has_second_head(name: str) -> bool:
    """Whether method `name` gives each client a second, personal head (`Method.second_head`: FedRoD)."""
    from peradapt.methods import METHODS

    return name in METHODS and METHODS[name].second_head


def _method_summary(name: str) -> str:
    from peradapt.methods import METHODS

    return METHODS[name].summary if name in METHODS else name


def write_cards(out: Path, cards: RunCards) -> None:
    """Write the card of every adapter exported to `out` (`out/clients/<id>/`, `out/global/`) and the federation's."""
    for client in cards.clients:
        directory = out / "clients" / str(client)
        if directory.is_dir():
            (directory / CARD_FILE).write_text(cards.adapter(client), encoding="utf-8")
    (out / "global" / CARD_FILE).write_text(cards.adapter(None), encoding="utf-8")
    (out / CARD_FILE).write_text(cards.federation(), encoding="utf-8")
