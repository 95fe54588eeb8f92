"""Shared fixtures: a small learnable Fashion-MNIST stand-in in IDX format and a backbone pretrained on it."""

from __future__ import annotations

import dataclasses
import gzip
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from peradapt.compute.costs import elements, own_elements
from peradapt.config import MethodConfig, setting_owners
from peradapt.methods import METHODS, Method

TINY_BACKBONE = "resnet10_w4"
TINY_VIT = "vit_tiny_p4_32"  # registered by peradapt: 32 px, patch 4


def idx_bytes(array: np.ndarray) -> bytes:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def striped_images(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """28x28 images whose class c (0-9) is the period (c + 2 px) of vertical stripes under noise: learnable in a
    few steps, and still telling after the crops and flips of augmentation."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, count)
    period = labels[:, None] + 2
    stripes = (np.arange(28)[None, :] % period) < period // 2
    images = rng.integers(0, 60, (count, 28, 28)) + 180 * stripes[:, None, :]
    return images.clip(0, 255), labels


def write_fmnist_like(directory: Path, num_train: int = 1800, num_test: int = 600) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for prefix, count, seed in (("train", num_train, 0), ("t10k", num_test, 1)):
        images, labels = striped_images(count, seed)
        (directory / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(idx_bytes(images)))
        (directory / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_bytes(labels)))
    return directory


def method_config(method: str | type[Method], /, **values: Any) -> tuple[MethodConfig, Any]:
    """The shared `MethodConfig` and the method's own settings (its `settings_class`) from flat values, split as
    `TrainConfig.from_flat` splits them, for a `MethodContext` built by hand. Other methods' settings are left out
    (a test's defaults for a family of methods), as they would have no effect."""
    cls = METHODS[method] if isinstance(method, str) else method
    own = {field.name for field in dataclasses.fields(cls.settings_class)}
    others = {key for key in values if key not in own and setting_owners(key)}
    shared = MethodConfig(**{key: value for key, value in values.items() if key not in own | others})
    return shared, cls.settings_class(**{key: value for key, value in values.items() if key in own})


def measured_counts(method: Method, client: Any, global_state: dict) -> dict[str, int]:
    """Per client, what a run measures (`federation.engine`: the round records' and the final evaluation's): the
    elements one client update of `client` trains and uploads, then the elements of its model that are its own."""
    trainer = method.trainer
    before = trainer.elements_trained
    update = method.client_update(client, method.payload(client.client_id, global_state), seed=0)
    trained = trainer.elements_trained - before
    personalized = own_elements(method.personalized(client.client_id, global_state), global_state)
    return {"personalized": personalized, "trained": trained, "communicated": elements(update.upload)}


def settings(fmnist_dir: Path, out: Path, **overrides: object) -> dict:
    """A tiny PerAda run on the stand-in as flat settings (`TrainConfig.from_flat`): 4 clients, 2 rounds."""
    return {
        "data": "fmnist",
        "data_dir": str(fmnist_dir),
        "backbone": TINY_BACKBONE,
        "clients": 4,
        "clients_per_round": 2,
        "rounds": 2,
        "partition": "dir:0.5",
        "local_epochs": 1,
        "personal_epochs": 1,
        "lr": 0.05,
        "batch_size": 32,
        "kd_steps": 4,
        "kd_batch_size": 32,
        "eval_every": 1,
        "device": "cpu",
        "out": str(out),
        **overrides,
    }


@pytest.fixture(scope="session")
def fmnist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fmnist_like(tmp_path_factory.mktemp("fmnist"))


@pytest.fixture(scope="session")
def pretrained_home(tmp_path_factory: pytest.TempPathFactory, fmnist_dir: Path) -> Path:
    """A PERADAPT_HOME holding the tiny backbone, pretrained once for the whole session."""
    from peradapt.commands.pretraining import pretrain
    from peradapt.options import PretrainOptions

    home = tmp_path_factory.mktemp("peradapt-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PERADAPT_HOME", str(home))
        config = PretrainOptions(
            data="fmnist", backbone=TINY_BACKBONE, epochs=6, batch_size=32, lr=0.1, data_dir=str(fmnist_dir)
        )
        pretrain(config)
    return home


@pytest.fixture
def home(pretrained_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PERADAPT_HOME", str(pretrained_home))
    return pretrained_home


@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny models (`pytestmark = pytest.mark.usefixtures("one_thread")`): a second intra-op thread
    only adds OpenMP waits, many when the machine is busy."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def vit_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised tiny ViT for grayscale images, as a weights file (no JSON: the data normalizes)."""
    import torch
    from safetensors.torch import save_file

    from peradapt.backbones import create_backbone

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("vit") / "vit.safetensors"
    save_file({k: v.contiguous() for k, v in create_backbone(TINY_VIT, 10, 1).state_dict().items()}, str(path))
    return path


def thread_environment() -> dict[str, str]:
    """The environment for a process a test starts and compares results with (a `peradapt train` whose files must
    equal an in-process run's): this process's torch thread count, so that it sums floats as this one does. Both
    variables, since torch takes MKL_NUM_THREADS over OMP_NUM_THREADS where both are set."""
    import torch

    threads = str(torch.get_num_threads())
    return {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test` runs a worker per core), each worker's torch gets its share of the cores:
    more threads than cores only makes them wait on each other. The processes a test starts get the same share
    (`thread_environment`), so that a run in a subprocess computes as the test's own: float sums depend on the
    threads. Tests that compare with a subprocess's results still pass `thread_environment()` themselves: their
    module may run on one thread (`one_thread`), and without pytest-xdist nothing is set here."""
    import os

    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))
        os.environ.update(thread_environment())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cuda` run where a CUDA GPU is visible (`make gpu-check`), or on the CPU where
    PERADAPT_CHECK_DEVICE=cpu says so (`gpu_check.py --device cpu`), and are skipped elsewhere."""
    import os

    import torch

    if torch.cuda.is_available() or os.environ.get("PERADAPT_CHECK_DEVICE") == "cpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (make gpu-check)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
