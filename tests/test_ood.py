"""OOD sets: generated Fashion-MNIST corruptions, the CIFAR-10-C / CIFAR-10.1 / image-folder loaders, `eval --ood`."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from PIL import Image

from peradapt.data.images import ImageSet
from peradapt.data.ood import GRAYSCALE_CORRUPTIONS, SEVERITIES, OodTarget, corrupt, load_ood
from peradapt.data.sources import SourceData, SourceSpec
from peradapt.errors import ConfigError, DataError

from .conftest import striped_images
from .test_cli import run_cli, tiny_args

NOISES = ("gaussian_noise", "shot_noise", "impulse_noise", "speckle_noise")


@pytest.fixture(scope="module")
def clean() -> np.ndarray:
    return striped_images(64, seed=5)[0].astype(np.uint8)


def change(images: np.ndarray, clean: np.ndarray) -> float:
    return float(np.abs(images.astype(np.float64) - clean).mean())


@pytest.mark.parametrize("corruption", list(GRAYSCALE_CORRUPTIONS))
def test_corruption_is_deterministic_and_changes_the_images(corruption, clean):
    first = corrupt(clean, corruption, 3, seed=7)
    assert first.dtype == np.uint8 and first.shape == clean.shape
    np.testing.assert_array_equal(first, corrupt(clean, corruption, 3, seed=7))
    assert change(first, clean) > 1.0
    if corruption in NOISES:  # random corruptions follow the seed
        assert not np.array_equal(first, corrupt(clean, corruption, 3, seed=8))


@pytest.mark.parametrize("corruption", [*NOISES, "gaussian_blur", "contrast", "brightness", "zoom_blur"])
def test_higher_severity_changes_the_images_more(corruption, clean):
    changes = [change(corrupt(clean, corruption, severity, seed=0), clean) for severity in SEVERITIES]
    assert all(a < b for a, b in itertools.pairwise(changes)), changes


def test_reference_formulas_on_known_values():
    flat = np.full((1, 8, 8), 100, dtype=np.uint8)
    # brightness 5: +0.3 in [0, 1]; contrast of a flat image: unchanged; blur of a flat image: unchanged.
    assert corrupt(flat, "brightness", 5, 0)[0, 0, 0] == int((100 / 255 + 0.3) * 255)
    assert np.abs(corrupt(flat, "contrast", 5, 0).astype(int) - 100).max() <= 1
    assert np.abs(corrupt(flat, "gaussian_blur", 5, 0).astype(int) - 100).max() <= 1
    with pytest.raises(ConfigError, match="severity"):
        corrupt(flat, "contrast", 6, 0)
    with pytest.raises(ConfigError, match="unknown corruption"):
        corrupt(flat, "fog", 1, 0)


def test_fmnist_c_parts_in_the_run_format_and_cached(fmnist_dir, tmp_path):
    target = OodTarget(SourceSpec("fmnist", fmnist_dir), 10, image_size=32, channels=3)
    ood_set = load_ood("fmnist-c", target, limit=20, seed=0, cache_dir=tmp_path)
    parts = ood_set.parts
    assert "Fashion-MNIST" in ood_set.provenance
    assert [(p.corruption, p.severity) for p in parts] == [(c, s) for c in GRAYSCALE_CORRUPTIONS for s in SEVERITIES]
    # The run's channels; Fashion-MNIST's 28 px kept, the model's inputs scale them to the run's 32 px.
    assert all(p.images.images.shape == (20, 3, 28, 28) and len(p.images.labels) == 20 for p in parts)
    cached = sorted(tmp_path.rglob("*.npz"))
    assert len(cached) == len(GRAYSCALE_CORRUPTIONS)
    # A second load reads the cache: make it recognizable, and check it is what comes back.
    path = next(p for p in cached if p.name == "contrast.npz")
    with np.load(path) as stored:
        images = stored["images"].copy()
    images[:] = 7
    np.savez_compressed(path, images=images)
    again = load_ood("fmnist-c", target, limit=20, seed=0, cache_dir=tmp_path).parts
    assert all(bool((p.images.images == 7).all()) == (p.corruption == "contrast") for p in again)
    # Another seed is another cache entry with other noise.
    other = load_ood("fmnist-c", target, limit=20, seed=1, cache_dir=tmp_path).parts
    assert not torch.equal(other[0].images.images, parts[0].images.images)
    with pytest.raises(ConfigError, match="cifar10"):
        load_ood("fmnist-c", OodTarget(SourceSpec("cifar10", fmnist_dir), 10, 32, 3), cache_dir=None)


def test_cifar10_c_layout(tmp_path):
    rng = np.random.default_rng(0)
    root = tmp_path / "data" / "CIFAR-10-C"
    root.mkdir(parents=True)
    labels = np.tile(np.arange(10, dtype=np.uint8), 5 * 3)  # 30 per severity
    np.save(root / "labels.npy", labels)
    for name in ("fog", "gaussian_noise"):
        np.save(root / f"{name}.npy", rng.integers(0, 256, (len(labels), 32, 32, 3), dtype=np.uint8))
    target = OodTarget(SourceSpec("cifar10", tmp_path / "data"), 10, image_size=32, channels=3)
    parts = load_ood("cifar10-c", target).parts
    assert [p.key for p in parts] == [f"{c}-{s}" for c in ("fog", "gaussian_noise") for s in SEVERITIES]
    stacked = np.load(root / "fog.npy")
    fog3 = next(p for p in parts if p.key == "fog-3")
    np.testing.assert_array_equal(fog3.images.images.permute(0, 2, 3, 1).numpy(), stacked[60:90])
    limited = load_ood(f"cifar10-c:{root}", OodTarget(SourceSpec("cifar10"), 10, 16, 1), limit=7).parts
    assert all(p.images.images.shape == (7, 1, 16, 16) for p in limited)
    # The same test images at every severity.
    assert all(torch.equal(p.images.labels, limited[0].images.labels) for p in limited)
    with pytest.raises(DataError, match="CIFAR-10-C not found"):  # a named path is never replaced by generation
        load_ood(f"cifar10-c:{tmp_path / 'nowhere'}", target)


def test_cifar10_1_layout(tmp_path):
    rng = np.random.default_rng(1)
    folder = tmp_path / "CIFAR-10.1" / "datasets"
    folder.mkdir(parents=True)
    data = rng.integers(0, 256, (12, 32, 32, 3), dtype=np.uint8)
    np.save(folder / "cifar10.1_v6_data.npy", data)
    np.save(folder / "cifar10.1_v6_labels.npy", np.arange(12) % 10)
    [part] = load_ood("cifar10.1", OodTarget(SourceSpec("cifar10", tmp_path), 10, 32, 3)).parts
    assert part.key == "cifar10.1" and part.images.labels.tolist() == [i % 10 for i in range(12)]
    np.testing.assert_array_equal(part.images.images.permute(0, 2, 3, 1).numpy(), data)
    with pytest.raises(DataError, match=r"cifar10\.1_v6_data\.npy"):
        load_ood("cifar10.1", OodTarget(SourceSpec("cifar10", tmp_path / "empty"), 10, 32, 3))
    with pytest.raises(DataError, match="--data-dir"):
        load_ood("cifar10.1", OodTarget(SourceSpec("cifar10"), 10, 32, 3))


def test_imagefolder_with_numeric_and_named_classes(tmp_path):
    root = tmp_path / "ood"
    for folder, value in (("0", 10), ("Trouser", 200), ("ankle_boot", 90)):
        (root / folder).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(np.full((40, 30, 3), value + i, dtype=np.uint8)).save(root / folder / f"{i}.png")
    (root / "Trouser" / "notes.txt").write_text("not an image")
    [part] = load_ood(f"imagefolder:{root}", OodTarget(SourceSpec("fmnist"), 10, image_size=28, channels=1)).parts
    assert part.images.images.shape == (6, 1, 28, 28)
    assert part.images.labels.tolist() == [0, 0, 1, 1, 9, 9]
    assert part.images.images[2].float().mean().item() == pytest.approx(200, abs=1)
    (root / "socks").mkdir()
    with pytest.raises(DataError, match="socks"):
        load_ood(f"imagefolder:{root}", OodTarget(SourceSpec("fmnist"), 10, 28, 1))
    with pytest.raises(DataError, match="not a directory"):
        load_ood(f"imagefolder:{tmp_path / 'missing'}", OodTarget(SourceSpec("fmnist"), 10, 28, 1))
    with pytest.raises(ConfigError, match="unknown OOD set"):
        load_ood("mnist-m", OodTarget(SourceSpec("fmnist"), 10, 28, 1))


def test_eval_ood_cli_writes_per_corruption_results(home, fmnist_dir, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    code, _, err = run_cli(tiny_args(fmnist_dir, run, "--rounds", "1"), capsys, monkeypatch)
    assert code == 0, err
    code, out, err = run_cli(["eval", "--run", str(run), "--ood", "fmnist-c", "--ood-limit", "50"], capsys, monkeypatch)
    assert code == 0, err
    assert "gaussian_noise-5" in out and "average" in out and "ood-fmnist-c.json" in out and "generated here" in out
    result = json.loads((run / "ood-fmnist-c.json").read_text())
    assert result["clients"] == [0, 1, 2, 3] and result["limit"] == 50
    parts = result["parts"]
    assert [(p["corruption"], p["severity"]) for p in parts] == [
        (c, s) for c in GRAYSCALE_CORRUPTIONS for s in SEVERITIES
    ]
    for row in [*parts, *result["corruptions"], result["average"]]:
        assert len(row["personalized"]) == 4 and all(0 <= a <= 1 for a in row["personalized"])
        assert row["personalized_mean"] == pytest.approx(np.mean(row["personalized"]))
        assert 0 <= row["global"] <= 1
    assert all(p["size"] == 50 for p in parts)
    assert len(result["corruptions"]) == len(GRAYSCALE_CORRUPTIONS)
    assert list((home / "ood").rglob("contrast.npz"))
    # Plain `eval` is unchanged; wrong uses are one-line errors.
    code, _, err = run_cli(["eval", "--run", str(run), "--ood-limit", "5"], capsys, monkeypatch)
    assert code == 2 and "--ood-limit needs --ood" in err
    code, _, err = run_cli(["eval", "--run", str(run), "--ood", "cifar10-c"], capsys, monkeypatch)
    assert code == 2 and "fmnist" in err


def test_cifar10_c_generated_with_imagecorruptions_when_files_are_absent(tmp_path, monkeypatch):
    """No CIFAR-10-C files: all 19 corruption types are made from the CIFAR-10 test set, deterministically, cached."""
    pytest.importorskip("imagecorruptions")  # the `corruptions` extra, part of `test`
    import peradapt.data.ood as ood

    rng = np.random.default_rng(3)
    test = ImageSet(
        torch.from_numpy(rng.integers(0, 256, (6, 3, 32, 32), dtype=np.uint8)), torch.arange(6) % 10, num_classes=10
    )
    loads = []

    def fake_cifar10(name, data_dir, download=False):
        loads.append((name, data_dir))
        return SourceData(name, train=test, test=test, mean=(0.5,) * 3, std=(0.25,) * 3)

    monkeypatch.setattr(ood, "load_source", fake_cifar10)
    target = OodTarget(SourceSpec("cifar10", tmp_path / "data"), 10, image_size=32, channels=3)
    cache = tmp_path / "cache"
    generated = load_ood("cifar10-c", target, limit=4, seed=0, cache_dir=cache)
    assert loads == [("cifar10", tmp_path / "data")] and "imagecorruptions" in generated.provenance
    corruptions = list(dict.fromkeys(p.corruption for p in generated.parts))
    assert len(corruptions) == 19 and {"frost", "fog", "glass_blur", "gaussian_blur", "saturate"} <= set(corruptions)
    assert [p.severity for p in generated.parts[:5]] == list(SEVERITIES)
    chosen = generated.parts[0].images.labels
    clean = test.images[[int(i) for i in chosen]]  # labels 0..5 are the image indices here
    for part in generated.parts:
        assert part.images.images.shape == (4, 3, 32, 32) and torch.equal(part.images.labels, chosen)
        assert not torch.equal(part.images.images, clean), part.key  # every corruption changes the images
    assert len(list(cache.rglob("*.npz"))) == 19
    # Same seed: the same images, from the cache; a fresh generation (no cache) agrees: deterministic.
    again = load_ood("cifar10-c", target, limit=4, seed=0, cache_dir=cache).parts
    fresh = load_ood("cifar10-c", target, limit=4, seed=0, cache_dir=None).parts
    for first, second, third in zip(generated.parts, again, fresh, strict=True):
        assert torch.equal(first.images.images, second.images.images)
        assert torch.equal(first.images.images, third.images.images)
    noisy = next(i for i, p in enumerate(generated.parts) if p.key == "gaussian_noise-3")
    other_seed = load_ood("cifar10-c", target, limit=4, seed=1, cache_dir=None).parts[noisy]
    assert not torch.equal(other_seed.images.images, generated.parts[noisy].images.images)
