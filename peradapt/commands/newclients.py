"""New clients: personalize a client that never took part in training, from a finished run's global model.

A new client is either a client that `peradapt train --holdout-clients K` kept out of the federation (the last K
ids; their data split is in partition.json) or the new client's own images: a directory (or ``imagefolder:PATH``)
of class folders, or a Hugging Face dataset (``hf:NAME_OR_PATH[:CONFIG]``, read as `peradapt.data.hfdata` reads
``--data hf:...``, its classes matched to the run's by name). `personalize_new_client`
trains its personalized model from the exported global model with the run's own method
(`Method.personalize_new_client`), measures its local-test accuracy with the global model before and with the
personalized model after, and exports it under `new_clients/<name>/` in the same layout as `clients/<id>/`, with
the accuracies in `new_clients/<name>/result.json`.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from peradapt.commands.finished_run import ExportedAdapters, image_target, open_run
from peradapt.compute.privacy import charged_to, client_privacy
from peradapt.data import ClientData, ImageSet
from peradapt.data.folders import PREFIX as IMAGEFOLDER_PREFIX
from peradapt.data.hfdata import PREFIX as HF_PREFIX
from peradapt.data.hfdata import load_hf
from peradapt.data.ood import OodTarget, load_imagefolder, relabel
from peradapt.errors import DataError, RunError
from peradapt.evaluation import metric_name
from peradapt.federation.finish import sample_flops
from peradapt.federation.session import Session
from peradapt.rundir.checkpoint import write_json_atomic
from peradapt.rundir.layout import RunPaths
from peradapt.rundir.lock import reads_run
from peradapt.seeds import NEW_CLIENT, derive_seed

NEW_CLIENTS_DIR = "new_clients"
TEST_SHARE = 0.25  # of a new client's images kept for its local test when its directory has no train/ and test/


@reads_run
def personalize_new_client(run_dir: Path, spec: str, *, weights: Path | None = None) -> dict:
    """Personalize new client `spec` (held-out id or image directory) of the finished run in `run_dir` (`weights`:
    the backbone's file where the run's copy is not here, `open_session`).

    Returns what `new_clients/<name>/result.json` records.
    """
    paths = RunPaths(run_dir)
    session = open_run(run_dir, weights)
    name, client = _new_client(session, spec, run_dir)
    if not paths.global_adapter.is_dir() or not paths.report.is_file():
        raise RunError(
            f"{run_dir} is not finished (no exported global model): finish it with "
            f"`peradapt train --out {run_dir} --resume`"
        )
    global_state = ExportedAdapters.open(session, paths).global_state  # a damaged one: how to export it again
    trainer, config = session.trainer, session.config
    before = trainer.score(global_state, client.test)
    trained = trainer.samples_trained
    with charged_to(trainer.privacy, session.store, client.client_id):  # a DP run personalizes with DP-SGD too
        personal = session.method.personalize_new_client(
            client, global_state, derive_seed(config.seed, client.client_id, NEW_CLIENT)
        )
    samples = trainer.samples_trained - trained
    after = trainer.score(personal, client.test)
    out = paths.root / NEW_CLIENTS_DIR / name
    session.model.save_pretrained(out, personal)
    result = {
        "client": name,
        "source": spec,
        "method": config.method.method,
        "metric": metric_name(client.test),
        "train_samples": len(client.train),
        "test_samples": len(client.test),
        "before": {"model": "global", "local_test": before},
        "after": {"model": "personalized", "local_test": after},
        "adapter": str(out),
        # the personalization's training work, counted as a round's (`peradapt.compute.costs`)
        "cost": {"samples": samples, "flops": samples * sample_flops(session).training},
        **client_privacy(trainer.privacy, session.store, client.client_id),
    }
    write_json_atomic(out / "result.json", result)
    return result


def _new_client(session: Session, spec: str, run_dir: Path) -> tuple[str, ClientData]:
    held_out = [client.client_id for client in session.held_out_clients]
    if spec.isdigit():
        client_id = int(spec)
        if client_id not in held_out:
            known = ", ".join(map(str, held_out)) if held_out else "none (train with --holdout-clients K)"
            raise RunError(
                f"client {client_id} is not held out in {run_dir}: --new-client must be one of the held-out "
                f"clients ({known}) or a directory of images"
            )
        return spec, session.data.clients[client_id]
    hub = spec.startswith(HF_PREFIX)
    path = Path(spec.removeprefix(IMAGEFOLDER_PREFIX)).expanduser()
    if not hub and not path.is_dir():
        raise RunError(
            f"--new-client {spec!r} is neither a held-out client id of this run nor a directory of images "
            "(DIR/<class>/<images>, or DIR/train/<class>/ and DIR/test/<class>/; also as imagefolder:DIR) nor "
            "hf:NAME_OR_PATH"
        )
    if session.data.global_test.multilabel:
        raise RunError(
            f"{run_dir} is a multi-label run ({session.config.data.data}): image folders give one class per image, "
            "so a new client must be a held-out client id (train with --holdout-clients K)"
        )
    if hub:
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", spec).strip("_")
        return name, _dataset_client(session, spec)
    return re.sub(r"[^A-Za-z0-9._-]+", "_", path.resolve().name), _directory_client(session, path)


def _directory_client(session: Session, path: Path) -> ClientData:
    """The images of `path` as a client: DIR/train and DIR/test when both exist, else a seeded split of DIR."""
    target = image_target(session)
    if (path / "train").is_dir() and (path / "test").is_dir():
        train, test = (load_imagefolder(path / split, target) for split in ("train", "test"))
    else:
        train, test = _split_off_test(session, load_imagefolder(path, target), path)
    empty = np.empty(0, dtype=np.int64)  # its images are not in the run's data
    return ClientData(len(session.data.clients), train, test, empty, empty)


def _split_off_test(session: Session, images: ImageSet, where: object) -> tuple[ImageSet, ImageSet]:
    """A seeded TEST_SHARE of ``images`` for the new client's test, the rest for its training."""
    if len(images) < 2:
        raise DataError(f"{where} holds {len(images)} image: a new client needs at least 2 (train and test)")
    order = np.random.default_rng([session.config.seed, NEW_CLIENT]).permutation(len(images))
    test_size = max(1, round(TEST_SHARE * len(images)))
    return images.subset(np.sort(order[test_size:])), images.subset(np.sort(order[:test_size]))


def _dataset_client(session: Session, spec: str) -> ClientData:
    """The Hugging Face dataset ``spec`` as a client: its train and test splits (else a seeded split of its
    training split), at the run's image size and channels, its classes matched to the run's by name."""
    target = image_target(session)
    run_source = target.source  # the new client's images are fitted and read as the run's were
    source = load_hf(
        spec,
        target.image_size,
        target.image_size,
        channels=target.channels,
        resize=run_source.resize,
        image_col=run_source.image_column,
        label_col=run_source.label_column,
        hints=True,
    )
    train = _in_run_classes(source.train, source.classes, target, spec)
    if source.test is None:
        train, test = _split_off_test(session, train, spec)
    else:
        test = _in_run_classes(source.test, source.classes, target, spec)
    empty = np.empty(0, dtype=np.int64)  # its images are not in the run's data
    return ClientData(len(session.data.clients), train, test, empty, empty)


def _in_run_classes(images: ImageSet, classes: tuple[str, ...], target: OodTarget, spec: str) -> ImageSet:
    relabeled, _ = relabel(images, classes, target, spec, strict=True)
    return relabeled
