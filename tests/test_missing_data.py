"""A dataset whose files are missing says so in one line, with where it looked and every remedy there is: a source
that `--download` fetches (fmnist, cifar10, cifar100, svhn, stl10) names both `--data-dir DIR` with its files and
`--download` (needs a network); one that cannot be downloaded (office-home, chexpert, the OOD sets of `eval`, which
has no --download) never mentions --download. Nothing here touches the network: downloads are stand-ins that fail
as they do offline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torchvision

from peradapt.data import load_source, sources
from peradapt.data.ood import OodTarget, load_ood
from peradapt.data.sources import SourceSpec
from peradapt.errors import DataError

from .conftest import TINY_BACKBONE
from .test_cli import expect_refusal

DOWNLOADABLE = ["fmnist", "cifar10", "cifar100", "svhn", "stl10"]
NOT_DOWNLOADABLE = ["office-home", "chexpert"]
NETWORK = "--download to fetch"


@pytest.fixture
def no_system_fmnist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "DEBIAN_FMNIST_DIR", tmp_path / "not-installed")


@pytest.fixture
def empty(tmp_path: Path) -> Path:
    directory = tmp_path / "empty"
    directory.mkdir()
    return directory


def train(data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *extra: str) -> tuple[list[str], Path]:
    """`peradapt train` of `data`, which stops at the data: the weights file (a stand-in) is read only later."""
    monkeypatch.setenv("PERADAPT_HOME", str(tmp_path / "home"))
    weights = tmp_path / "weights.safetensors"
    weights.touch()
    run = tmp_path / "run"
    args = ["train", "--data", data, "--backbone", TINY_BACKBONE, "--weights", str(weights), "--device", "cpu"]
    return [*args, "--out", str(run), *extra], run


@pytest.mark.usefixtures("no_system_fmnist")
@pytest.mark.parametrize("data", DOWNLOADABLE)
def test_a_downloadable_source_missing_from_its_data_dir_names_data_dir_and_download(
    data, empty, tmp_path, capsys, monkeypatch
):
    args, run = train(data, tmp_path, monkeypatch, "--data-dir", str(empty))
    err = expect_refusal(args, capsys, monkeypatch, "not found", str(empty), "--data-dir", NETWORK, untouched=run)
    message = err.strip()
    assert message.index("not found") < message.index(str(empty)) < message.index(NETWORK)  # where, then remedies
    assert message.endswith("there (needs a network)"), message
    assert not any(empty.iterdir())  # nothing fetched


@pytest.mark.usefixtures("no_system_fmnist")
@pytest.mark.parametrize("data", DOWNLOADABLE)
def test_a_downloadable_source_without_data_dir_names_data_dir_and_download(data, tmp_path, capsys, monkeypatch):
    args, run = train(data, tmp_path, monkeypatch)
    err = expect_refusal(args, capsys, monkeypatch, "not found", "--data-dir DIR", untouched=run)
    assert "add --data-dir DIR --download to fetch" in err and err.strip().endswith("(needs a network)"), err


@pytest.mark.usefixtures("no_system_fmnist")
@pytest.mark.parametrize("data", DOWNLOADABLE)
def test_download_without_data_dir_asks_for_one(data, tmp_path, capsys, monkeypatch):
    args, run = train(data, tmp_path, monkeypatch, "--download")
    expect_refusal(args, capsys, monkeypatch, "--download needs --data-dir DIR", untouched=run)


@pytest.mark.parametrize("data", DOWNLOADABLE)
def test_a_data_dir_that_does_not_exist_offers_download(data, tmp_path, capsys, monkeypatch):
    args, run = train(data, tmp_path, monkeypatch, "--data-dir", str(tmp_path / "nowhere"))
    expect_refusal(args, capsys, monkeypatch, "does not exist", NETWORK, untouched=run)


@pytest.mark.parametrize("data", NOT_DOWNLOADABLE)
@pytest.mark.parametrize("where", ["empty", "none", "nowhere"])
def test_a_source_that_cannot_be_downloaded_never_mentions_download(data, where, empty, tmp_path, capsys, monkeypatch):
    extra = {"empty": ("--data-dir", str(empty)), "none": (), "nowhere": ("--data-dir", str(tmp_path / "nowhere"))}
    args, run = train(data, tmp_path, monkeypatch, *extra[where])
    says = "does not exist" if where == "nowhere" else "peradapt cannot download it"
    err = expect_refusal(args, capsys, monkeypatch, says, untouched=run)
    assert "--download" not in err, err


@pytest.mark.parametrize(
    ("data", "stand_in"),
    [
        ("fmnist", "FashionMNIST"),
        ("cifar10", "CIFAR10"),
        ("cifar100", "CIFAR100"),
        ("svhn", "SVHN"),
        ("stl10", "STL10"),
    ],
)
def test_a_failed_download_says_so_and_what_to_do_offline(data, stand_in, empty, tmp_path, capsys, monkeypatch):
    asked = []

    def offline(*args, **kwargs):
        asked.append(kwargs.get("download"))
        raise OSError("<urlopen error [Errno -3]\nTemporary failure in name resolution>")

    offline.url = "https://example.invalid/archive.tar.gz"  # where CIFAR's message says to get it by hand
    monkeypatch.setattr(torchvision.datasets, stand_in, offline)
    args, run = train(data, tmp_path, monkeypatch, "--data-dir", str(empty), "--download")
    err = expect_refusal(
        args, capsys, monkeypatch, f"into {empty}", "Temporary failure in name resolution", untouched=run
    )
    assert asked and all(asked) and "could not download" in err and "without a network" in err, err
    assert "--download" not in err, err  # it was given: the remedy is the files by hand


@pytest.mark.parametrize("kind", ["svhn", "stl10", "cifar10.1"])
def test_ood_sets_of_eval_never_mention_download(kind, empty):
    # `eval --ood` reads its sets from files only (it takes no --download), in PATH or the run's --data-dir.
    target = OodTarget(SourceSpec("cifar10", empty), 10, image_size=8, channels=3)
    for name in (kind, f"{kind}:{empty}"):
        with pytest.raises(DataError) as caught:
            load_ood(name, target)
        message = str(caught.value)
        assert "not found" in message and str(empty) in message and f"--ood {kind}:PATH" in message, message
        assert "--download" not in message and "\n" not in message, message


def test_corrupted_cifar_files_are_told_apart_from_missing_ones(empty):
    (empty / "cifar-10-batches-py").mkdir()
    (empty / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"not a pickle")
    with pytest.raises(DataError) as caught:
        load_source("cifar10", empty)
    message = str(caught.value)
    assert "not found or corrupted" in message and "md5" in message and "delete cifar-10-batches-py/" in message
    assert message.endswith("(needs a network)"), message
