"""Operations on a finished run directory: evaluate its exported adapters, export them, describe the run."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from peradapt.adapters import AdapterState
from peradapt.adapters.merge import MergedNetwork, merged_network
from peradapt.adapters.model import ADAPTER_CONFIG_FILE, FULL_MODEL_FILE
from peradapt.backbones import BackboneInfo, save_backbone
from peradapt.backbones.hf import HF_PREFIX, is_hf
from peradapt.commands.cards import (
    CARD_FILE,
    HubTarget,
    RunCards,
    check_license,
    public_backbone,
    public_weights,
    write_cards,
)
from peradapt.config import TrainConfig, check_output_path
from peradapt.data.ood import OodTarget
from peradapt.data.sources import SourceSpec
from peradapt.errors import ConfigError, RunError, WeightsError, writing
from peradapt.evaluation import evaluate_adapters, mean_and_std
from peradapt.federation.session import Session, open_session
from peradapt.progress import progress_display, text_console
from peradapt.rundir.checkpoint import write_json_atomic
from peradapt.rundir.files import damaged, first_missing, read_json
from peradapt.rundir.layout import RunPaths, read_partition, read_report, read_run_config
from peradapt.rundir.lock import reads_run
from peradapt.rundir.records import Report, Resolved


def open_run(run_dir: Path, weights: Path | None = None) -> Session:
    return open_session(run_dir, weights=weights)


@dataclass
class ExportedAdapters:
    """The adapters `train` exported into a run directory, read one client at a time, so that memory does not grow
    with the clients. Clients in a row whose files are byte-identical (e.g. never-sampled clients holding the
    initial adapter) get the same state object, which `evaluate_adapters` scores in one pass."""

    session: Session
    paths: RunPaths
    global_state: AdapterState
    _last: tuple[bytes | None, AdapterState] | None = field(default=None, init=False, repr=False)

    @classmethod
    def open(cls, session: Session, paths: RunPaths) -> ExportedAdapters:
        if not paths.report.is_file():  # written last, after every adapter: the run and its export are whole
            raise RunError(
                f"{paths.root} is not finished (no report.json: its training or final export did not end): "
                f"finish it with `peradapt train --out {paths.root} --resume`"
            )
        return cls(session, paths, _load_exported(session, paths, paths.global_adapter))

    def personalized(self, client_id: int) -> AdapterState:
        directory = self.paths.clients / str(client_id)
        path = directory / self.session.model.weights_file
        content = path.read_bytes() if path.is_file() else None
        if content is None or self._last is None or self._last[0] != content:
            self._last = (content, _load_exported(self.session, self.paths, directory))  # refuses a missing one
        return self._last[1]

    def check_complete(self) -> None:
        """Refuse a run whose client adapters are missing, damaged or unlike its global adapter (which `open`
        loaded): their headers and adapter configs only, which is fast."""
        name, remedy = self.session.model.weights_file, _reexport(self.paths)
        expected = _tensor_shapes(self.paths.global_adapter / name, remedy)
        configs = [] if self.session.model.scope == "full" else [ADAPTER_CONFIG_FILE]
        described = {config: read_json(self.paths.global_adapter / config, remedy) for config in configs}
        for client in self.session.federated_clients:
            directory = self.paths.clients / str(client.client_id)
            if not (directory / name).is_file() or _tensor_shapes(directory / name, remedy) != expected:
                raise RunError(f"{directory / name} is missing or unlike the global adapter: {remedy}")
            for config, content in described.items():
                if not (directory / config).is_file() or read_json(directory / config, remedy) != content:
                    raise RunError(f"{directory / config} is missing or unlike the global adapter's: {remedy}")


def _reexport(paths: RunPaths) -> str:
    """What to do about a damaged exported adapter: `--resume` of a run redoes its final evaluation and export."""
    return f"export the run's adapters again with `peradapt train --out {paths.root} --resume`"


def _load_exported(session: Session, paths: RunPaths, directory: Path) -> AdapterState:
    """The adapter that `train` exported to `directory`; a missing, damaged or foreign one is a RunError that says
    how to export it again."""
    try:
        return session.model.load_pretrained(directory)
    except WeightsError as exc:
        raise RunError(f"{exc}: {_reexport(paths)}") from None


def _tensor_shapes(path: Path, remedy: str) -> dict[str, list[int]]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {name: handle.get_slice(name).get_shape() for name in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as exc:
        raise damaged(path, f"not a readable safetensors file: {exc}", remedy) from None


@reads_run
def evaluate_run(run_dir: Path, *, weights: Path | None = None) -> dict:
    """local-test of every exported personalized adapter and of the global adapter, and their global-test (of a
    sample of the personalized adapters in a large federation: see `Session.client_sample`); `weights`: the
    backbone's file where the run's copy is not here (`open_session`)."""
    paths = RunPaths(run_dir)
    session = open_run(run_dir, weights)
    adapters = ExportedAdapters.open(session, paths)
    evaluation = evaluate_adapters(
        session.trainer,
        adapters.personalized,
        adapters.global_state,
        session.federated_clients,
        session.data.global_test,
        global_test_clients={client.client_id for client in session.client_sample},
    )
    # --eval-split validation: its "test" scores are on the validation splits, as in its report.json
    evaluation["eval_split"] = session.config.data.eval_split
    write_json_atomic(run_dir / "eval.json", evaluation)
    return evaluation


def image_target(session: Session) -> OodTarget:
    """The image format and classes that the run's models take, for data from outside the run."""
    source = SourceSpec.of(session.config.data)
    return OodTarget(
        source, session.data.num_classes, session.data.image_size, session.data.channels, session.data.classes
    )


@reads_run
def evaluate_ood_run(
    run_dir: Path,
    name: str,
    *,
    limit: int | None = None,
    seed: int = 0,
    weights: Path | None = None,
    console: Console | None = None,
) -> dict:
    """Accuracy of every exported personalized adapter and of the global adapter on each part of OOD set ``name``.

    Writes ``ood-<name>.json`` (``/`` and ``:`` of a path replaced) in the run directory and returns it: where the
    images come from, then per (corruption, severity), per corruption averaged over severities, and overall, each
    with the clients' accuracies, their mean and std, and the global adapter's accuracy.
    """
    from peradapt.data.ood import load_ood
    from peradapt.home import peradapt_home

    paths = RunPaths(run_dir)
    session = open_run(run_dir, weights)
    if session.data.global_test.multilabel:
        raise ConfigError(
            f"{run_dir} is a multi-label run ({session.config.data.data}): the OOD sets are single-label class sets"
        )
    adapters = ExportedAdapters.open(session, paths)
    clients = [client.client_id for client in session.client_sample]
    with progress_display(console or text_console(stderr=True)) as progress:
        ready = progress.add_task(f"{name}: corruption types ready", total=None)
        ood_set = load_ood(
            name,
            image_target(session),
            limit=limit,
            seed=seed,
            cache_dir=peradapt_home() / "ood",
            on_generated=lambda total: progress.update(ready, total=total, advance=1),
        )
        parts = ood_set.parts
        evaluated = progress.add_task(f"{name}: models evaluated", total=len(clients) + 1)

        def accuracies(state: dict) -> list[float]:  # model by model: each adapter is loaded once for all parts
            values = [session.trainer.score(state, part.images) for part in parts]
            progress.advance(evaluated)
            return values

        personal_acc = {c: accuracies(adapters.personalized(c)) for c in clients}
        global_acc = accuracies(adapters.global_state)

    def entry(columns: list[int], **fields: object) -> dict:
        per_client = [float(np.mean([personal_acc[c][i] for i in columns])) for c in clients]
        stats = mean_and_std(per_client)
        return {
            **fields,
            "personalized": per_client,
            "personalized_mean": stats["mean"],
            "personalized_std": stats["std"],
            "global": float(np.mean([global_acc[i] for i in columns])),
        }

    corruptions = list(dict.fromkeys(part.corruption for part in parts))
    result = {
        "ood": name,
        "provenance": ood_set.provenance,
        "limit": limit,
        "seed": seed,
        "clients": clients,
        "parts": [
            entry([i], corruption=part.corruption, severity=part.severity, size=len(part.images))
            for i, part in enumerate(parts)
        ],
        "corruptions": [
            entry([i for i, part in enumerate(parts) if part.corruption == corruption], corruption=corruption)
            for corruption in corruptions
        ],
        "average": entry(list(range(len(parts)))),
    }
    write_json_atomic(run_dir / ood_report_name(name), result)
    return result


def ood_report_name(name: str) -> str:
    """The file ``evaluate_ood_run`` writes for OOD set ``name``: ``ood-<name>.json``, made safe as a file name."""
    return "ood-" + re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") + ".json"


def ood_table(result: dict, title: str) -> Table:
    """The rich table of an ``evaluate_ood_run`` result: every part, then per-corruption and overall averages."""
    table = Table(title=title)
    table.add_column("set")
    table.add_column("images", justify="right")
    table.add_column("personalized % (mean ± std over clients)", justify="right")
    table.add_column("global %", justify="right")

    def add(label: str, size: str, row: dict, **style: str) -> None:
        personal = f"{100 * row['personalized_mean']:.2f} ± {100 * row['personalized_std']:.2f}"
        table.add_row(label, size, personal, f"{100 * row['global']:.2f}", **style)

    for part in result["parts"]:
        label = part["corruption"] if part["severity"] is None else f"{part['corruption']}-{part['severity']}"
        add(label, str(part["size"]), part)
    if len(result["corruptions"]) < len(result["parts"]):  # severities: also each corruption's average
        table.add_section()
        for row in result["corruptions"]:
            add(f"{row['corruption']} (average)", "", row)
    table.add_section()
    add("average", "", result["average"], style="bold")
    return table


MERGED_WEIGHTS = FULL_MODEL_FILE  # model.safetensors, as timm and transformers name a model's weights
# What `export_run` writes into its directory. A directory of these alone (clients/ and global/ among them) holds an
# earlier export, which a new one replaces; a directory with anything else in it is never written to.
_EXPORT_ENTRIES = frozenset({"clients", "global", "backbone.safetensors", "backbone.json", "backbone", CARD_FILE})


@reads_run
def export_run(
    run_dir: Path,
    out: Path,
    *,
    hub: HubTarget | None = None,
    merge: bool = False,
    license: str | None = None,
    weights: Path | None = None,
) -> Path:
    """Copy the run's adapters to `out` with the frozen backbone they were trained on, ready to load with PEFT, and
    a model card (README.md) for each and for the federation (`hub`: the upload they will describe, if any;
    `license`: the license the cards declare, default the backbone weights' own where known). `merge`: instead,
    each client's model (and the global one) with its adapters folded into the backbone, a plain timm or
    transformers model that loads without peradapt (`peradapt.adapters.merge`). `weights`: the backbone's file
    where the run's copy is not here (`open_session`).

    The export is written into a new directory beside `out`, then moved into place: it replaces an earlier export
    at `out` as a whole (no client of an earlier, larger run is left), and a failed export leaves `out` as it was.
    `out` must be new, empty or an earlier export: other files are never overwritten or deleted."""
    out = out.resolve() if out.is_symlink() else out
    _check_export_target(run_dir, out)
    if license is not None:
        check_license(license)
    paths = RunPaths(run_dir)
    session = open_run(run_dir, weights)
    adapters = ExportedAdapters.open(session, paths)
    adapters.check_complete()
    # What does not merge is refused before anything is written; the global model, merged here, is exported as it is.
    backbone = session.config.backbone.backbone
    merged_global = merged_network(session.model, adapters.global_state, backbone) if merge else None
    created = first_missing(out.parent)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.export-{uuid.uuid4().hex[:12]}")
    try:
        with writing(out):  # a write that names no file (a full disk) names the export
            staging.mkdir()
            _write_export(session, paths, staging, adapters, merged_global)
            report = read_report(run_dir)
            assert report is not None  # ExportedAdapters.open refuses a run without one
            cards = RunCards(session.config, read_run_config(run_dir)[1], report, hub, license=license, merged=merge)
            write_cards(staging, cards)
            _move_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created is not None:  # the directories made for `out`, which hold nothing else
            shutil.rmtree(created, ignore_errors=True)
        raise
    return out


def _check_export_target(run_dir: Path, out: Path) -> None:
    check_output_path(out, "--out", directory=True)
    run, target = run_dir.resolve(), out.resolve()
    if target == run or run in target.parents:
        where = "is the run directory" if target == run else f"is inside the run directory {run_dir}"
        raise ConfigError(f"--out {out} {where}: export to a directory outside the run")
    if out.is_dir() and any(out.iterdir()) and not _is_export(out):
        raise ConfigError(
            f"--out {out} holds files that are no peradapt export: give a new or empty directory (an earlier "
            "export there is replaced, nothing else)"
        )


def _is_export(directory: Path) -> bool:
    """Whether `directory` holds what `export_run` writes and nothing else (a merged export has no backbone)."""
    entries = {entry.name for entry in directory.iterdir()}
    if not (entries <= _EXPORT_ENTRIES and {"clients", "global"} <= entries):
        return False
    clients = directory / "clients"
    return (directory / "global").is_dir() and clients.is_dir() and all(c.name.isdigit() for c in clients.iterdir())


def _write_export(
    session: Session, paths: RunPaths, out: Path, adapters: ExportedAdapters, merged_global: MergedNetwork | None
) -> None:
    """The export into `out`: the run's adapters with the backbone, or with `merged_global` (`export --merge`) every
    model merged."""
    info = BackboneInfo(
        public_backbone(session.config.backbone.backbone),
        session.data.channels,
        session.data.image_size,
        session.trainer.inputs.mean,
        session.trainer.inputs.std,
        public_weights(session.backbone.source) or "",  # no path of this machine in an export
        session.class_names,
    )
    if merged_global is not None:
        _write_merged(session, adapters, info, out, merged_global)
        return
    for name in ("clients", "global"):
        shutil.copytree(paths.root / name, out / name)
    if session.model.scope != "full":
        _name_base_model(out, info.backbone)
    plain = session.model.backbone_state()
    if not is_hf(info.backbone):
        save_backbone(plain, info, out / "backbone.safetensors")
        return
    # A transformers model directory (config with the task's classes and channels + weights): from_pretrained
    # loads it, and `--backbone hf:OUT/backbone` trains on it again. Its description is OUT/backbone.json, as for timm.
    directory = out / "backbone"
    _save_transformers(session.model.base_model.config, plain, info, directory)
    info.save(directory)  # writes directory.with_suffix(".json")


def _name_base_model(out: Path, backbone: str) -> None:
    """PEFT records where the base model was loaded from (`base_model_name_or_path`: for a transformers backbone, its
    directory on this machine): every exported adapter config names the backbone as the export does instead. The
    configs are one and the same (`ExportedAdapters.check_complete`): rewritten once, written to every adapter."""
    config = json.loads((out / "global" / ADAPTER_CONFIG_FILE).read_text(encoding="utf-8"))
    if config.get("base_model_name_or_path") is None:
        return
    config["base_model_name_or_path"] = backbone.removeprefix(HF_PREFIX)
    text = json.dumps(config, indent=2, sort_keys=True)
    for directory in (out / "global", *(out / "clients").iterdir()):
        (directory / ADAPTER_CONFIG_FILE).write_text(text, encoding="utf-8")


def _write_merged(
    session: Session, adapters: ExportedAdapters, info: BackboneInfo, out: Path, merged_global: MergedNetwork
) -> None:
    """Every client's model and the global one (`merged_global`), adapters folded into the backbone
    (`merged_network`): each a plain timm or transformers model directory, complete in itself."""
    backbone = session.config.backbone.backbone
    _save_merged(merged_global, info, out / "global")
    for client in session.federated_clients:
        merged = merged_network(session.model, adapters.personalized(client.client_id), backbone)
        _save_merged(merged, info, out / "clients" / str(client.client_id))


def _save_merged(merged: MergedNetwork, info: BackboneInfo, directory: Path) -> None:
    tensors = merged.network.state_dict()
    if is_hf(info.backbone):
        _save_transformers(merged.network.config, tensors, info, directory)
        return
    directory.mkdir(parents=True)
    with writing(directory / MERGED_WEIGHTS):
        save_file(tensors, str(directory / MERGED_WEIGHTS), metadata={"format": "pt"})
    config = timm_config(merged, info)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def timm_config(merged: MergedNetwork, info: BackboneInfo) -> dict:
    """config.json of a merged timm model, in the layout timm's Hub export writes and `timm.create_model` reads
    (`hf-hub:` and `local-dir:` names): how to build it with timm alone, its classes and its input."""
    return {
        "architecture": merged.architecture,
        "num_classes": len(info.classes),
        "model_args": merged.model_args,
        "label_names": list(info.classes),
        "pretrained_cfg": {
            "input_size": [info.in_chans, info.image_size, info.image_size],
            # peradapt resizes whole images to the square (no crop), bilinearly
            "interpolation": "bilinear",
            "crop_pct": 1.0,
            "crop_mode": "squash",
            "mean": list(info.mean),
            "std": list(info.std),
        },
    }


def _save_transformers(config: Any, tensors: dict[str, torch.Tensor], info: BackboneInfo, directory: Path) -> None:
    """A transformers model directory: config.json (with the class names as id2label), model.safetensors and
    preprocessor_config.json (what `AutoImageProcessor` and `pipeline("image-classification")` read: resize to
    the model's square, scale to [0, 1], normalize with the run's statistics)."""
    from transformers import ViTImageProcessor

    config = copy.deepcopy(config)
    config.id2label = dict(enumerate(info.classes))
    config.label2id = {name: index for index, name in enumerate(info.classes)}
    config._name_or_path = ""  # where it was loaded from on this machine
    config.save_pretrained(str(directory))
    contiguous = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    with writing(directory / MERGED_WEIGHTS):
        save_file(contiguous, str(directory / MERGED_WEIGHTS), metadata={"format": "pt"})
    processor = ViTImageProcessor(
        do_resize=True,
        size={"height": info.image_size, "width": info.image_size},
        resample=2,  # PIL's bilinear, as peradapt decodes
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=list(info.mean),
        image_std=list(info.std),
        do_convert_rgb=info.in_chans == 3,
    )
    processor.save_pretrained(str(directory))


def _move_into_place(staging: Path, out: Path) -> None:
    """Rename `staging` to `out`; an `out` there (empty, or an earlier export) is renamed away first and deleted
    once the new export is in place, or put back if it cannot be."""
    if not out.exists():
        os.replace(staging, out)
        return
    old = staging.with_name(staging.name + ".old")
    os.replace(out, old)
    try:
        os.replace(staging, out)
    except BaseException:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)  # the new export is in place whatever is left of the old one


@dataclass(frozen=True)
class RunInfo:
    """What `peradapt info` shows of a run: its files, each checked, and the label skew of its partition."""

    config: TrainConfig
    resolved: Resolved
    partition: dict
    report: Report | None  # None: not finished
    label_skew: float


def run_info(run_dir: Path) -> RunInfo:
    """The run's config, resolved values, partition and report (each file checked before any is shown)."""
    config, resolved = read_run_config(run_dir)
    partition = read_partition(run_dir)
    skew = label_skew([client["train_histogram"] for client in partition["clients"]])
    return RunInfo(config, resolved, partition, read_report(run_dir), skew)


def label_skew(histograms: list[list[int]]) -> float:
    """Mean total-variation distance between each client's label distribution and the pooled one (0 = IID)."""
    counts = np.asarray(histograms, dtype=float)
    pooled = counts.sum(0) / counts.sum()
    per_client = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    return float(0.5 * np.abs(per_client - pooled).sum(1).mean())
