"""Operations on a finished run directory: evaluate its exported adapters, export them, describe the run."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from peradapt.backbones import BackboneInfo, save_backbone
from peradapt.errors import RunError
from peradapt.evaluation import evaluate_adapters
from peradapt.federation.checkpoint import write_json_atomic
from peradapt.federation.session import RunPaths, Session, build_session, read_partition, read_run_config


def open_run(run_dir: Path) -> Session:
    config, _ = read_run_config(run_dir)
    return build_session(config, read_partition(run_dir))


def _exported_states(session: Session, paths: RunPaths) -> tuple[dict[int, dict], dict]:
    if not paths.global_adapter.is_dir():
        raise RunError(
            f"{paths.root} has no exported adapters yet: finish it with `peradapt train --out {paths.root} --resume`"
        )
    personal = {
        c.client_id: session.model.load_pretrained(paths.clients / str(c.client_id)) for c in session.data.clients
    }
    return personal, session.model.load_pretrained(paths.global_adapter)


def evaluate_run(run_dir: Path) -> dict:
    """local-test and global-test of every exported personalized adapter and of the global adapter."""
    paths = RunPaths(run_dir)
    session = open_run(run_dir)
    personal, global_state = _exported_states(session, paths)
    evaluation = evaluate_adapters(
        session.trainer,
        personal.__getitem__,
        global_state,
        session.data.clients,
        session.data.global_test,
        personalized_global_test=True,
    )
    write_json_atomic(run_dir / "eval.json", evaluation)
    return evaluation


def export_run(run_dir: Path, out: Path) -> Path:
    """Copy the run's adapters to `out` with the frozen backbone they were trained on, ready to load with PEFT."""
    paths = RunPaths(run_dir)
    session = open_run(run_dir)
    _exported_states(session, paths)  # refuses runs whose adapters are missing or do not fit
    out.mkdir(parents=True, exist_ok=True)
    for name in ("clients", "global"):
        shutil.copytree(paths.root / name, out / name, dirs_exist_ok=True)
    # The base model's own tensors, under timm's names: PEFT keeps them as `base_layer` / `original_module`.
    wrapped = session.model.module.get_base_model().state_dict()
    plain = {
        k.replace(".original_module", "").replace(".base_layer", ""): v
        for k, v in wrapped.items()
        if "lora_" not in k and "modules_to_save" not in k
    }
    info = BackboneInfo(
        session.config.backbone.backbone,
        session.data.channels,
        session.data.image_size,
        session.trainer.inputs.mean,
        session.trainer.inputs.std,
        session.backbone.source,
    )
    save_backbone(plain, info, out / "backbone.safetensors")
    return out


def label_skew(histograms: list[list[int]]) -> float:
    """Mean total-variation distance between each client's label distribution and the pooled one (0 = IID)."""
    counts = np.asarray(histograms, dtype=float)
    pooled = counts.sum(0) / counts.sum()
    per_client = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    return float(0.5 * np.abs(per_client - pooled).sum(1).mean())
