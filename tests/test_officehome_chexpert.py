"""Office-Home and CheXpert from their on-disk layouts: loaders, the decode cache, domain and meta-category
partitions, multi-label training (BCE, AUC, multi-label distillation) and both datasets through the CLI."""

from __future__ import annotations

import csv
import json
import math
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file, save_file
from sklearn.metrics import roc_auc_score

import peradapt.distill.kd as kd_module
from peradapt.config import DataConfig, DistillConfig
from peradapt.data import ImageSet, build_federation, fixed_splits, load_source
from peradapt.data import chexpert as chexpert_module
from peradapt.data import decode as decode_module
from peradapt.data.officehome import DOMAINS
from peradapt.distill import Distiller, multilabel_kd_loss
from peradapt.errors import ConfigError, DataError
from peradapt.evaluation import mean_auc, roc_auc
from peradapt.methods import METHODS

from .conftest import TINY_BACKBONE
from .test_cli import expect_user_error, run_cli
from .test_perada import image_set, tiny_trainer

CLASSES = ("Backpack", "Alarm_Clock", "Calculator")  # class index = position in sorted order
PER_CLASS = 6
CHEXPERT_HEADER = [
    *("Path", "Sex", "Age", "Frontal/Lateral", "AP/PA", "No Finding", "Enlarged Cardiomediastinum", "Cardiomegaly"),
    *("Lung Opacity", "Lung Lesion", "Edema", "Consolidation", "Pneumonia", "Atelectasis", "Pneumothorax"),
    *("Pleural Effusion", "Pleural Other", "Fracture", "Support Devices"),
]
TASKS = ("Cardiomegaly", "Edema", "Consolidation", "Atelectasis", "Pleural Effusion")
# Rows whose U-Ones labels the test checks by hand: -1 (uncertain) and 1 are positive, blank and 0 negative.
HAND_ROWS = {
    0: {"Cardiomegaly": "-1.0", "Edema": "", "Consolidation": "1.0", "Atelectasis": "0.0", "Pleural Effusion": "-1.0"},
    1: dict.fromkeys(TASKS, ""),
    2: {"Cardiomegaly": "0.0", "Edema": "1.0", "Consolidation": "-1.0", "Atelectasis": "", "Pleural Effusion": "0.0"},
}
HAND_LABELS = {0: [1, 0, 1, 0, 1], 1: [0, 0, 0, 0, 0], 2: [0, 1, 1, 0, 0]}
U_ONES = {"": 0, "0.0": 0, "1.0": 1, "-1.0": 1}


def write_image(path: Path, rng: np.random.Generator, grey: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (30, 40) if grey else (30, 40, 3), dtype=np.uint8)).save(path)


def write_office_home(root: Path) -> Path:
    """Four domains x 3 classes x 6 images (PNG and JPEG, 40x30), plus a file that is no image."""
    rng = np.random.default_rng(0)
    for domain in DOMAINS:
        for name in CLASSES:
            for index in range(PER_CLASS):
                write_image(root / domain / name / f"{index:05d}{'.jpg' if index % 2 else '.png'}", rng)
        (root / domain / CLASSES[0] / "Thumbs.db").write_bytes(b"not an image")
    return root


def write_chexpert(parent: Path, folder: str = "CheXpert-v1.0-small", rows: int = 60) -> list[dict[str, str]]:
    """train.csv (frontal and lateral views, labels blank/0/1/-1) and valid.csv with their grayscale JPEGs."""
    rng = np.random.default_rng(1)
    observations = CHEXPERT_HEADER[5:]
    records = []
    for index in range(rows):
        view = "frontal" if index % 2 == 0 else "lateral"
        path = f"{folder}/train/patient{index // 2 + 1:05d}/study1/view{index % 2 + 1}_{view}.jpg"
        labels = rng.choice(["", "0.0", "1.0", "-1.0"], size=len(observations), p=[0.5, 0.25, 0.125, 0.125])
        record = {"Path": path, "Sex": "Female", "Age": "60", "Frontal/Lateral": view.title(), "AP/PA": ""}
        record.update(zip(observations, labels, strict=True))
        record.update(HAND_ROWS.get(index, {}))
        records.append(record)
        write_image(parent / path, rng, grey=True)
    write_csv(parent / folder / "train.csv", records)
    write_csv(
        parent / folder / "valid.csv",
        [{**row, "Path": row["Path"].replace("/train/", "/valid/")} for row in records[:3]],
    )
    return records


def write_csv(path: Path, records: list[dict[str, str]]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, CHEXPERT_HEADER)
        writer.writeheader()
        writer.writerows(records)


def u_ones(records: list[dict[str, str]]) -> np.ndarray:
    return np.array([[U_ONES[record[task]] for task in TASKS] for record in records], dtype=np.float32)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def office_home_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("office-home")
    write_office_home(data / "OfficeHomeDataset_10072016")
    return data


@pytest.fixture(scope="module")
def chexpert_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, str]]]:
    data = tmp_path_factory.mktemp("chexpert")
    return data, write_chexpert(data)


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PERADAPT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


# ---------------------------------------------------------------- Office-Home


@pytest.mark.usefixtures("cache_home")
def test_office_home_classes_domains_and_pixels(office_home_dir: Path) -> None:
    source = load_source("office-home", office_home_dir, image_size=8)
    count = len(DOMAINS) * len(CLASSES) * PER_CLASS
    assert source.train.images.shape == (count, 3, 8, 8) and source.test is None
    assert source.train.num_classes == 3 and not source.train.multilabel
    # Sorted class folders: Alarm_Clock 0, Backpack 1, Calculator 2; files in domain, class, name order.
    per_domain = [label for label in range(3) for _ in range(PER_CLASS)]
    assert source.train.labels.tolist() == per_domain * len(DOMAINS)
    assert source.domains.names == DOMAINS and source.domains.kind == "domains"
    assert source.domains.ids.tolist() == [d for d in range(4) for _ in range(3 * PER_CLASS)]
    png = office_home_dir / "OfficeHomeDataset_10072016" / "Clipart" / "Backpack" / "00000.png"
    expected = np.asarray(Image.open(png).convert("RGB").resize((8, 8), Image.Resampling.BILINEAR))
    row = 1 * 3 * PER_CLASS + 1 * PER_CLASS  # Clipart (domain 1), Backpack (class 1), first file
    np.testing.assert_array_equal(source.train.images[row].permute(1, 2, 0).numpy(), expected)
    direct = load_source("office-home", office_home_dir / "OfficeHomeDataset_10072016", image_size=8)
    assert torch.equal(direct.train.images, source.train.images)


@pytest.mark.usefixtures("cache_home")
def test_office_home_layouts_and_mistakes(tmp_path: Path, office_home_dir: Path) -> None:
    with pytest.raises(DataError, match=r"hemanthdv\.org"):
        load_source("office-home", tmp_path)
    spaced = write_office_home(tmp_path / "spaced")
    (spaced / "Real_World").rename(spaced / "Real World")  # as the official archive spells it
    assert len(load_source("office-home", spaced, image_size=4).train) == len(DOMAINS) * len(CLASSES) * PER_CLASS
    broken = write_office_home(tmp_path / "broken")
    (broken / "Product" / "Backpack").rename(broken / "Product" / "Bicycle")
    with pytest.raises(DataError, match="different class folders"):
        load_source("office-home", broken)


@pytest.mark.usefixtures("cache_home")
def test_domain_partition_gives_each_domain_to_one_client(office_home_dir: Path) -> None:
    data = DataConfig("office-home", office_home_dir, partition="domain", kd_data="digits", image_size=8)
    fed = build_federation(data, num_clients=4, seed=0)
    source = load_source("office-home", office_home_dir, image_size=8)
    splits = fixed_splits("office-home", len(source.train), 0, limit_samples=None)
    assert not set(splits.pool) & set(splits.test) and not set(splits.val) & (set(splits.pool) | set(splits.test))
    assert len(splits.test) == 7 and len(splits.val) == 6  # 1/10 and 9/100 of the 72 images
    domains = source.domains.ids
    for client in fed.clients:
        assert set(domains[splits.pool[client.train_indices]]) == {client.client_id}
        assert set(domains[splits.test[client.test_indices]]) <= {client.client_id}
        assert torch.equal(client.train.images, source.train.images[splits.pool[client.train_indices]])
    assert sorted(np.concatenate([c.train_indices for c in fed.clients]).tolist()) == list(range(len(splits.pool)))
    assert sorted(np.concatenate([c.test_indices for c in fed.clients]).tolist()) == list(range(len(splits.test)))
    record = fed.partition
    assert record["histograms_of"] == "domains" and record["groups"] == list(DOMAINS)
    for client in record["clients"]:
        assert [n for i, n in enumerate(client["train_histogram"]) if i != client["id"]] == [0, 0, 0]
    assert fed.kd.images.shape[1:] == (3, 8, 8) and (fed.channels, fed.image_size) == (3, 8)


@pytest.mark.usefixtures("cache_home")
def test_domain_partition_mistakes(office_home_dir: Path) -> None:
    with pytest.raises(ConfigError, match="use --clients 4, not 3"):
        build_federation(DataConfig("office-home", office_home_dir, partition="domain"), num_clients=3, seed=0)
    with pytest.raises(ConfigError, match="fmnist has none"):
        build_federation(DataConfig("fmnist", partition="domain"), num_clients=4, seed=0)
    data = DataConfig("office-home", office_home_dir, partition="dir:1", kd_data="digits", image_size=8)
    pooled = build_federation(data, num_clients=3, seed=0)
    assert pooled.partition["histograms_of"] == "classes" and "groups" not in pooled.partition
    assert len(pooled.partition["clients"][0]["train_histogram"]) == 3


# ---------------------------------------------------------------- CheXpert


@pytest.mark.usefixtures("cache_home")
@pytest.mark.parametrize("folder", ["CheXpert-v1.0-small", "CheXpert-v1.0"])
def test_chexpert_labels_are_u_ones_of_the_five_tasks(tmp_path: Path, folder: str) -> None:
    records = write_chexpert(tmp_path, folder, rows=8)
    source = load_source("chexpert", tmp_path, image_size=12)
    assert source.train.images.shape == (8, 1, 12, 12) and source.test is None  # lateral views included
    assert source.train.multilabel and source.train.labels.dtype == torch.float32
    for row, expected in HAND_LABELS.items():
        assert source.train.labels[row].tolist() == expected
    np.testing.assert_array_equal(source.train.labels.numpy(), u_ones(records))
    image = Image.open(tmp_path / records[3]["Path"])
    image.draft("L", (12, 12))
    expected_pixels = np.asarray(image.convert("L").resize((12, 12), Image.Resampling.BILINEAR))
    np.testing.assert_array_equal(source.train.images[3, 0].numpy(), expected_pixels)
    inside = load_source("chexpert", tmp_path / folder, image_size=12)  # DIR may be the dataset folder itself
    assert torch.equal(inside.train.labels, source.train.labels)


@pytest.mark.usefixtures("cache_home")
def test_chexpert_mistakes_are_data_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="stanfordmlgroup"):
        load_source("chexpert", tmp_path)
    records = write_chexpert(tmp_path, rows=4)
    train_csv = tmp_path / "CheXpert-v1.0-small" / "train.csv"
    records[2]["Edema"] = "2.0"
    write_csv(train_csv, records)
    with pytest.raises(DataError, match=r"train\.csv line 4: Edema is '2\.0'"):
        load_source("chexpert", tmp_path, image_size=8)
    train_csv.write_text("Path,Edema\nx.jpg,1.0\n")
    with pytest.raises(DataError, match="Cardiomegaly, Consolidation"):
        load_source("chexpert", tmp_path, image_size=8)


def test_meta_categories_on_a_hand_count() -> None:
    none, card, edema, both = [0, 0, 0, 0, 0], [1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [1, 1, 0, 0, 0]
    labels = np.array([card, none, card, both, edema, card, none], dtype=np.float32)
    groups = chexpert_module.meta_categories(labels, min_images=2)
    # Frequent combinations in lexicographic order: none (2 images) 0, Cardiomegaly (3) 1; the two rare ones 2.
    assert groups.ids.tolist() == [1, 0, 1, 2, 2, 1, 0]
    assert groups.names[:2] == ("none", "Cardiomegaly") and groups.names[2].startswith("other (2 combinations")
    assert chexpert_module.meta_categories(labels, min_images=1).names == (
        "none",
        "Edema",
        "Cardiomegaly",
        "Cardiomegaly+Edema",
    )


@pytest.mark.usefixtures("cache_home")
def test_chexpert_federation_partitions_meta_categories_of_the_whole_training_set(chexpert_data, monkeypatch) -> None:
    data, records = chexpert_data
    monkeypatch.setattr(chexpert_module, "RARE_COMBINATION_IMAGES", 4)
    counts = Counter(tuple(row) for row in u_ones(records).astype(int).tolist())
    frequent = sorted(combination for combination, count in counts.items() if count >= 4)
    fed = build_federation(
        DataConfig("chexpert", data, partition="dir:0.5", kd_data="digits", image_size=8), num_clients=3, seed=0
    )
    record = fed.partition
    assert record["histograms_of"] == "meta-categories" and len(record["groups"]) == len(frequent) + 1
    assert record["groups"][-1].startswith(f"other ({len(counts) - len(frequent)} combinations")
    assert (fed.num_classes, fed.channels, fed.image_size) == (5, 1, 8)
    assert fed.val.multilabel and fed.global_test.multilabel and fed.kd.labels is None
    assert len(fed.val) == 6 and record["test_size"] == 5  # 1/10 and 9/100 of train.csv's 60 rows
    pool_total = sum(sum(client["train_histogram"]) for client in record["clients"])
    assert pool_total == record["pool_size"] == 49
    limited_data = DataConfig("chexpert", data, partition="iid", kd_data="digits", limit_samples=10, image_size=8)
    limited = build_federation(limited_data, num_clients=2, seed=0)
    assert limited.partition["groups"] == record["groups"]  # counted before --limit-samples
    with pytest.raises(DataError, match=r"--kd-data cifar10: .* --kd-data digits"):  # auto: the paper's CIFAR-10
        build_federation(DataConfig("chexpert", data, partition="iid", image_size=8), num_clients=3, seed=0)


# ---------------------------------------------------------------- the decode cache


def test_second_load_reads_the_cache_instead_of_decoding(chexpert_data, cache_home, monkeypatch) -> None:
    data, records = chexpert_data
    decoded = []
    decode_file = decode_module._decode_file

    def counting(file, **options):
        decoded.append(file)
        return decode_file(file, **options)

    monkeypatch.setattr(decode_module, "_decode_file", counting)
    first = load_source("chexpert", data, image_size=10)
    assert len(decoded) == len(records)
    cached = list((cache_home / "cache").glob("chexpert-10px-L-*.npy"))
    assert len(cached) == 1 and not list((cache_home / "cache").glob("*.tmp"))

    # An image damaged in place (same size and time) is not read again: the cache serves it.
    image = data / records[0]["Path"]
    stat = image.stat()
    original = image.read_bytes()
    image.write_bytes(b"\0" * len(original))
    os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    again = load_source("chexpert", data, image_size=10)
    assert len(decoded) == len(records) and torch.equal(again.train.images, first.train.images)
    image.write_bytes(original)
    os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    load_source("chexpert", data, image_size=12)  # another size is another cache entry
    assert len(decoded) == 2 * len(records)
    cached[0].write_bytes(cached[0].read_bytes()[:100])  # a damaged cache is decoded again
    assert torch.equal(load_source("chexpert", data, image_size=10).train.images, first.train.images)
    assert len(decoded) == 3 * len(records)
    touched = data / records[1]["Path"]
    os.utime(touched, ns=(touched.stat().st_atime_ns, touched.stat().st_mtime_ns + 10**9))
    load_source("chexpert", data, image_size=10)  # a changed file changes the key
    assert len(decoded) == 4 * len(records)


# ---------------------------------------------------------------- multi-label training and scoring


def test_roc_auc_by_hand_and_against_sklearn() -> None:
    assert roc_auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == pytest.approx(0.75)
    # Ties count half: pairs (0.5 > 0.5?) 1/2, (0.5 > 0.2) 1, (0.9 > 0.5) 1, (0.9 > 0.2) 1, of 4.
    assert roc_auc(np.array([0.5, 0.5, 0.2, 0.9]), np.array([1, 0, 0, 1])) == pytest.approx(0.875)
    assert math.isnan(roc_auc(np.array([0.1, 0.2]), np.array([1, 1])))
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 6, (50, 4)).astype(float)  # many ties
    labels = (rng.random((50, 4)) < 0.3).astype(np.float32)
    labels[:, 3] = 0  # one class only: skipped
    expected = np.mean([roc_auc_score(labels[:, k], scores[:, k]) for k in range(3)])
    assert mean_auc(torch.tensor(scores), torch.tensor(labels)) == pytest.approx(expected)
    assert math.isnan(mean_auc(torch.tensor(scores), torch.zeros(50, 4)))


def multi_hot_set(count: int, seed: int) -> ImageSet:
    images = image_set(count, seed).images
    labels = (torch.rand(count, 3, generator=torch.Generator().manual_seed(seed)) < 0.5).float()
    return ImageSet(images, labels, num_classes=3)


def test_image_set_validates_multi_hot_labels() -> None:
    data = multi_hot_set(4, seed=0)
    assert data.multilabel and data.subset([2, 0]).multilabel
    assert not image_set(4, seed=0).multilabel
    with pytest.raises(ValueError, match="float32"):
        ImageSet(data.images, torch.zeros(4, 2), num_classes=3)
    with pytest.raises(ValueError, match="0 or 1"):
        ImageSet(data.images, torch.full((4, 3), 0.5), num_classes=3)


def test_loss_is_bce_for_multi_hot_labels_and_score_is_auc() -> None:
    trainer = tiny_trainer()
    data = multi_hot_set(12, seed=1)
    state = trainer.model.state()
    trainer.model.load_state(state)
    trainer.model.eval()
    images = trainer.inputs(data.images)
    with torch.no_grad():
        logits = trainer.model(images)
        expected = F.binary_cross_entropy_with_logits(logits, data.labels)
        assert trainer.loss(images, data.labels, lr=0.1).item() == pytest.approx(expected.item(), rel=1e-6)
        classes = data.labels.argmax(dim=1)
        expected_ce = F.cross_entropy(logits, classes)
        assert trainer.loss(images, classes, lr=0.1).item() == pytest.approx(expected_ce.item(), rel=1e-6)
    assert trainer.score(state, data) == pytest.approx(mean_auc(logits, data.labels))
    trained, loss = trainer.sgd(state, data, epochs=1, lr=0.1, seed=0)  # SGD on BCE runs end to end
    assert math.isfinite(loss) and trained.keys() == state.keys()


def test_multilabel_kd_loss_by_hand() -> None:
    student, teacher = torch.tensor([[0.0, 0.0]]), torch.tensor([[math.log(3.0), 0.0]])
    # Label 1: teacher sigmoid 3/4 against 1/2; label 2: both 1/2, so 0; mean over the two labels.
    expected = (0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)) / 2
    assert multilabel_kd_loss(student, teacher, 1.0).item() == pytest.approx(expected, rel=1e-6)
    p = 1 / (1 + math.exp(-math.log(3.0) / 2))  # T = 2: sigmoid(t / 2), times T^2
    expected = 4 * (p * math.log(p / 0.5) + (1 - p) * math.log((1 - p) / 0.5)) / 2
    assert multilabel_kd_loss(student, teacher, 2.0).item() == pytest.approx(expected, rel=1e-6)
    assert multilabel_kd_loss(teacher, teacher, 1.0).item() == pytest.approx(0.0, abs=1e-7)


def test_distiller_uses_the_per_label_loss_when_asked(monkeypatch) -> None:
    trainer = tiny_trainer()
    calls = []

    def recording(student, teacher, temperature):
        calls.append(student.shape)
        return multilabel_kd_loss(student, teacher, temperature)

    monkeypatch.setattr(kd_module, "multilabel_kd_loss", recording)
    kd_data = image_set(16, seed=2, labeled=False)
    config = DistillConfig(kd_steps=2, kd_batch_size=8, kd_loss="bernoulli")
    distiller = Distiller(trainer, kd_data, multi_hot_set(8, seed=3), config)
    _, info = distiller.distill(trainer.model.state(), [trainer.model.state()], seed=0)
    assert calls == [(8, 3), (8, 3)] and 0.0 <= info["kd_val_after"] <= 1.0


# ---------------------------------------------------------------- end to end through the CLI


def file_args(data: str, data_dir: Path, out: Path, weights: Path | None, *extra: str) -> list[str]:
    return [
        "train",
        *("--data", data, "--data-dir", str(data_dir), "--backbone", TINY_BACKBONE),
        *(("--weights", str(weights)) if weights else ()),
        *("--image-size", "16", "--kd-data", "digits", "--rounds", "1", "--local-epochs", "1"),
        *("--personal-epochs", "1", "--batch-size", "16", "--kd-steps", "2", "--kd-batch-size", "32"),
        *("--eval-every", "0", "--device", "cpu", "--out", str(out)),
        *extra,
    ]


@pytest.fixture
def tiny_weights(home: Path) -> Path:
    """The tiny backbone pretrained on (grayscale) Fashion-MNIST: CheXpert's grayscale images fit it."""
    return home / "backbones" / f"fmnist-{TINY_BACKBONE}.safetensors"


@pytest.fixture
def rgb_weights(tiny_weights: Path, tmp_path: Path) -> Path:
    """The same backbone for RGB images: the grayscale stem filter shared by the three channels."""
    weights = load_file(str(tiny_weights))
    weights["conv1.weight"] = weights["conv1.weight"].repeat(1, 3, 1, 1) / 3
    save_file(weights, str(tmp_path / "rgb.safetensors"))
    return tmp_path / "rgb.safetensors"


def test_office_home_trains_from_the_command_line(office_home_dir, rgb_weights, tmp_path, capsys, monkeypatch):
    out = tmp_path / "office"
    extra = ("--partition", "domain", "--clients", "4", "--clients-per-round", "4")
    code, stdout, err = run_cli(
        file_args("office-home", office_home_dir, out, rgb_weights, *extra), capsys, monkeypatch
    )
    assert code == 0, err
    assert "accuracy %" in stdout
    report = json.loads((out / "report.json").read_text())
    assert report["metric"] == "accuracy" and report["clients"] == [0, 1, 2, 3]
    resolved = json.loads((out / "config.json").read_text())["resolved"]
    assert (resolved["num_classes"], resolved["channels"], resolved["image_size"]) == (3, 3, 16)
    partition = json.loads((out / "partition.json").read_text())
    assert partition["spec"] == "domain" and partition["groups"] == list(DOMAINS)


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_trains_on_chexpert(method, chexpert_data, tiny_weights, tmp_path, capsys, monkeypatch):
    data, _ = chexpert_data
    monkeypatch.setattr(chexpert_module, "RARE_COMBINATION_IMAGES", 4)
    out = tmp_path / method
    extra = ("--method", method, "--partition", "dir:1", "--clients", "3", "--clients-per-round", "2")
    code, stdout, err = run_cli(file_args("chexpert", data, out, tiny_weights, *extra), capsys, monkeypatch)
    if method == "fedrod":  # its Balanced Softmax needs each client's class counts: multi-hot labels are refused
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(errors) == 1 and "multi-label" in errors[0] and not out.exists()
        return
    assert code == 0, err
    assert "AUC %" in stdout
    report = json.loads((out / "report.json").read_text())
    assert report["metric"] == "auc"
    for value in report["personalized"]["local_test"]["per_client"] + [report["global"]["global_test"]]:
        assert math.isnan(value) or 0.0 <= value <= 1.0
    partition = json.loads((out / "partition.json").read_text())
    assert partition["histograms_of"] == "meta-categories"


def test_chexpert_without_weights_says_how_to_get_them(chexpert_data, home, tmp_path, capsys, monkeypatch):
    data, _ = chexpert_data
    args = file_args("chexpert", data, tmp_path / "run", None, "--clients", "3", "--clients-per-round", "2")
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 2 and err.startswith("error:") and "Traceback" not in err
    assert "no split for `peradapt pretrain`" in err and "--weights" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("data", "extra", "needles"),
    [
        ("office-home", ("--partition", "domain", "--clients", "3"), ["--partition domain", "use --clients 4"]),
        ("chexpert", ("--partition", "domain", "--clients", "4"), ["chexpert has none", "dir:ALPHA"]),
        ("chexpert", ("--image-size", "0", "--clients", "3"), ["--image-size"]),
    ],
)
def test_dataset_mistakes_exit_2_in_one_line(
    data, extra, needles, office_home_dir, chexpert_data, tiny_weights, tmp_path, capsys, monkeypatch, home
):
    data_dir = office_home_dir if data == "office-home" else chexpert_data[0]
    # with weights: a run without them is refused first, before its data is read (test_logs_and_checks)
    args = file_args(data, data_dir, tmp_path / "run", tiny_weights, "--clients-per-round", "2", *extra)
    expect_user_error(args, capsys, monkeypatch, *needles)
    assert not (tmp_path / "run").exists()
