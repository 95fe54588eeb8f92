"""`--eval-split validation`: clients scored on validation splits carved from their training images (what
`compare --tune` scores trials on), the test images never reaching the model."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from peradapt.commands.training import train
from peradapt.compute.trainer import InputPipeline
from peradapt.config import TrainConfig
from peradapt.errors import DataError
from peradapt.federation.session import build_session

from .conftest import idx_bytes, settings, striped_images

pytestmark = pytest.mark.usefixtures("one_thread", "home")

WHITE = 255  # every pixel of every test image, and of no training image: a test image is recognized in any batch


@pytest.fixture(scope="module")
def marked_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Fashion-MNIST-like files whose test images are all white and whose training images never are."""
    directory = tmp_path_factory.mktemp("marked-fmnist")
    for prefix, count, seed in (("train", 1200, 0), ("t10k", 400, 1)):
        images, labels = striped_images(count, seed)
        images = np.full_like(images, WHITE) if prefix == "t10k" else np.minimum(images, WHITE - 1)
        (directory / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(idx_bytes(images)))
        (directory / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_bytes(labels)))
    return directory


def white_images_seen(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts, per model input batch, the white (test) images in it: every image reaches the model through an
    `InputPipeline` (client training, evaluation, distillation)."""
    seen: list[int] = []
    original = InputPipeline.__call__

    def counting(self, images, generator=None):
        seen.append(int((images.flatten(1) == WHITE).all(dim=1).sum()))
        return original(self, images, generator)

    monkeypatch.setattr(InputPipeline, "__call__", counting)
    return seen


def test_a_validation_run_never_feeds_a_test_image_to_the_model(
    marked_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = white_images_seen(monkeypatch)
    report = train(TrainConfig.from_flat(settings(marked_dir, tmp_path / "validation", eval_split="validation")))
    assert seen and sum(seen) == 0
    assert 0 <= report.summary["personalized_local_test"] <= 1
    assert report.eval_split == "validation"  # what its "test" scores are on, for whoever reads the report
    # The marker works: the same run scored on the test split feeds the white images to the model.
    train(TrainConfig.from_flat(settings(marked_dir, tmp_path / "test", rounds=1)))
    assert sum(seen) > 0


def test_validation_splits_are_a_share_of_each_clients_training_images(marked_dir: Path, tmp_path: Path) -> None:
    tested = build_session(TrainConfig.from_flat(settings(marked_dir, tmp_path / "a")))
    validated = build_session(TrainConfig.from_flat(settings(marked_dir, tmp_path / "b", eval_split="validation")))
    # The same clients: the partition (and partition.json) is the test split's.
    assert json.dumps(validated.data.partition) == json.dumps(tested.data.partition)
    records = tested.data.partition["clients"]
    for client, record in zip(validated.data.clients, records, strict=True):
        kept, validation = set(client.train_indices.tolist()), set(client.test_indices.tolist())
        assert kept | validation == set(record["train"]) and not kept & validation
        assert len(validation) == max(1, round(0.2 * len(record["train"])))
        assert len(client.train) == len(kept) and len(client.test) == len(validation)
    total = sum(len(client.test) for client in validated.data.clients)
    assert len(validated.data.global_test) == total
    # Drawn from the seed alone: building the session again gives the same validation images.
    again = build_session(TrainConfig.from_flat(settings(marked_dir, tmp_path / "c", eval_split="validation")))
    assert all(
        np.array_equal(a.test_indices, b.test_indices)
        for a, b in zip(again.data.clients, validated.data.clients, strict=True)
    )


def test_a_client_too_small_to_hold_out_an_image_is_refused(marked_dir: Path, tmp_path: Path) -> None:
    flat = settings(marked_dir, tmp_path / "run", eval_split="validation", clients=200, limit_samples=420)
    with pytest.raises(DataError, match="too few to hold one out"):
        build_session(TrainConfig.from_flat({**flat, "partition": "iid"}))
    assert not (tmp_path / "run").exists()
