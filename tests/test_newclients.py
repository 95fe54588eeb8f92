"""New clients: `train --holdout-clients K` keeps clients out of training; `personalize` adapts one afterwards."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from peradapt.commands.finished_run import open_run
from peradapt.config import TrainConfig
from peradapt.errors import ConfigError
from peradapt.methods import METHODS
from peradapt.methods.fedavg import FineTuning
from peradapt.methods.partial import PartialModel

from .conftest import TINY_BACKBONE
from .test_cli import run_cli, run_main, tiny_args

HELD_OUT = 3  # tiny_args has --clients 4: --holdout-clients 1 keeps the last id out


@pytest.fixture(scope="module")
def holdout_run(tmp_path_factory, pretrained_home, fmnist_dir) -> Path:
    """A tiny PerAda run with client 3 held out."""
    run = tmp_path_factory.mktemp("runs") / "holdout"
    run_main(tiny_args(fmnist_dir, run, "--holdout-clients", "1"), pretrained_home)
    return run


def test_held_out_client_never_trains_and_is_not_exported(holdout_run, capsys, monkeypatch, home):
    metrics = [json.loads(line) for line in (holdout_run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3
    assert all(HELD_OUT not in m["clients"] and len(m["clients"]) == 2 for m in metrics)
    assert sorted({c for m in metrics for c in m["clients"]}) == [0, 1, 2]  # the others do get sampled
    assert sorted(p.name for p in (holdout_run / "clients").iterdir()) == ["0", "1", "2"]
    report = json.loads((holdout_run / "report.json").read_text())
    assert report["clients"] == [0, 1, 2] and report["held_out_clients"] == [HELD_OUT]
    partition = json.loads((holdout_run / "partition.json").read_text())
    assert [c["id"] for c in partition["clients"]] == [0, 1, 2, 3]  # its data split is kept
    assert len(partition["clients"][HELD_OUT]["train"]) > 0
    code, _, err = run_cli(["eval", "--run", str(holdout_run)], capsys, monkeypatch)  # eval skips it too
    assert code == 0, err
    assert json.loads((holdout_run / "eval.json").read_text())["clients"] == [0, 1, 2]


def test_personalize_perada_new_client_records_before_and_after(holdout_run, capsys, monkeypatch, home):
    code, out, err = run_cli(
        ["personalize", "--run", str(holdout_run), "--new-client", str(HELD_OUT)], capsys, monkeypatch
    )
    assert code == 0, err
    exported = holdout_run / "new_clients" / str(HELD_OUT)
    result = json.loads((exported / "result.json").read_text())
    before, after = result["before"]["local_test"], result["after"]["local_test"]
    assert result["client"] == str(HELD_OUT) and result["method"] == "perada"
    assert 0.0 <= before <= 1.0 and 0.0 <= after <= 1.0 and after != before
    assert f"{100 * before:.2f}%" in out and f"{100 * after:.2f}%" in out
    assert (exported / "adapter_config.json").is_file()
    # its work, as a round's: --personal-epochs 1 of the proximal personal update over its training images
    flops = json.loads((holdout_run / "report.json").read_text())["cost"]["training_flops_per_sample"]
    assert result["cost"] == {"samples": result["train_samples"], "flops": result["train_samples"] * flops}

    session = open_run(holdout_run)
    personal = session.model.load_pretrained(exported)
    global_state = session.model.load_pretrained(holdout_run / "global")
    test = session.data.clients[HELD_OUT].test
    assert session.trainer.score(personal, test) == pytest.approx(after)
    assert session.trainer.score(global_state, test) == pytest.approx(before)
    assert any(not torch.equal(personal[name], global_state[name]) for name in global_state)


def test_personalize_apfl_new_client_learns_from_the_fixed_global_model(
    tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    run = tmp_path / "apfl"
    args = tiny_args(fmnist_dir, run, "--holdout-clients", "1", "--method", "apfl", "--rounds", "1")
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    code, _, err = run_cli(["personalize", "--run", str(run), "--new-client", str(HELD_OUT)], capsys, monkeypatch)
    assert code == 0, err
    result = json.loads((run / "new_clients" / str(HELD_OUT) / "result.json").read_text())
    assert result["method"] == "apfl" and result["after"]["local_test"] != result["before"]["local_test"]

    session = open_run(run)
    personal = session.model.load_pretrained(run / "new_clients" / str(HELD_OUT))  # a full model (APFL's scope)
    client = session.data.clients[HELD_OUT]
    assert session.trainer.score(personal, client.test) == pytest.approx(result["after"]["local_test"])
    # alpha and v are learned; w is the global model and stays fixed: the result is their mixture with it
    global_state = session.model.load_pretrained(run / "global")
    mixed = session.method.personalize_new_client(client, global_state, seed=0)
    alpha, v = session.method.alpha(HELD_OUT), session.method.local_model(HELD_OUT)
    assert alpha != pytest.approx(0.5)  # moved from --apfl-alpha
    torch.testing.assert_close(mixed, session.method.mix(alpha, v, global_state))
    assert any(not torch.equal(v[name], global_state[name]) for name in session.model.trainable_parameters())


def test_personalize_refuses_clients_that_were_not_held_out(holdout_run, capsys, monkeypatch, home):
    for spec, message in (("0", "held-out clients (3)"), ("7", "held-out clients (3)"), ("somewhere", "directory")):
        code, _, err = run_cli(["personalize", "--run", str(holdout_run), "--new-client", spec], capsys, monkeypatch)
        assert code == 2
        assert message in err and len(err.strip().splitlines()) == 1


def test_personalize_refuses_unfinished_runs(holdout_run, tmp_path, capsys, monkeypatch, home):
    unfinished = tmp_path / "unfinished"
    shutil.copytree(holdout_run, unfinished, ignore=shutil.ignore_patterns("global", "report.json", "new_clients"))
    code, _, err = run_cli(["personalize", "--run", str(unfinished), "--new-client", "3"], capsys, monkeypatch)
    assert code == 2 and "not finished" in err and "--resume" in err
    assert not (unfinished / "new_clients").exists()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"clients": 4, "clients_per_round": 2, "holdout_clients": 4}, "less than --clients 4"),
        ({"clients": 4, "clients_per_round": 2, "holdout_clients": -1}, "at least 0"),
        ({"clients": 4, "clients_per_round": 3, "holdout_clients": 2}, "left in training"),
    ],
)
def test_holdout_clients_is_validated(settings, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_flat(settings)
    TrainConfig.from_flat({**settings, "holdout_clients": 0})  # without holding out, the same settings are valid


def tiny_session(fmnist_dir: Path, method: str, **overrides):
    """A session of the tiny federation for `method` (settings in `overrides` win), built without a run."""
    from peradapt.federation.session import build_session

    settings = {
        "data": "fmnist",
        "data_dir": str(fmnist_dir),
        "backbone": TINY_BACKBONE,
        "clients": 4,
        "clients_per_round": 2,
        "holdout_clients": 1,
        "partition": "dir:0.5",
        "local_epochs": 1,
        "personal_epochs": 1,
        "lr": 0.05,
        "batch_size": 32,
        "kd_steps": 1,
        "kd_batch_size": 32,
        "device": "cpu",
        "method": method,
        **overrides,
    }
    return build_session(TrainConfig.from_flat(settings))


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_personalizes_a_new_client_from_the_global_model(method, fmnist_dir, home):
    session = tiny_session(fmnist_dir, method)
    torch.manual_seed(1)  # a global model unlike the initial one, so that "from the global model" is visible
    trainable = session.model.trainable_parameters()
    global_state = {k: v + 0.01 * torch.randn_like(v) if k in trainable else v for k, v in session.initial.items()}
    kept = {k: v.clone() for k, v in global_state.items()}
    client = session.held_out_clients[0]
    state = session.method.personalize_new_client(client, global_state, seed=5)

    assert state.keys() == global_state.keys()
    assert all(torch.equal(global_state[k], kept[k]) for k in kept)  # the global model stays fixed
    changed = {k for k in trainable if not torch.equal(state[k], global_state[k])}
    if method in ("fedavg", "feddf", "feddyn", "fedprox-li", "scaffold"):  # no personalization: the global model
        assert not changed
    else:
        assert changed
    method_object = session.method
    # Only the personal part trains, the shared part is the global one (FedBABU fine-tunes the whole model).
    if isinstance(method_object, PartialModel) and not isinstance(method_object, FineTuning):
        assert changed <= set(method_object.personal)
        assert all(torch.equal(state[k], global_state[k]) for k in method_object.shared)


def write_imagefolder(directory: Path, images: torch.Tensor, labels: torch.Tensor) -> None:
    for index, (image, label) in enumerate(zip(images, labels, strict=True)):
        (directory / str(int(label))).mkdir(parents=True, exist_ok=True)
        Image.fromarray(image[0].numpy()).save(directory / str(int(label)) / f"{index:04d}.png")


def test_personalize_a_directory_of_images(holdout_run, tmp_path, capsys, monkeypatch, home):
    """The held-out client's own images, written as image folders: the same data, so the same global accuracy."""
    session = open_run(holdout_run)
    client = session.data.clients[HELD_OUT]
    new = tmp_path / "hospital b"
    write_imagefolder(new / "train", client.train.images, client.train.labels)
    write_imagefolder(new / "test", client.test.images, client.test.labels)
    code, _, err = run_cli(["personalize", "--run", str(holdout_run), "--new-client", str(new)], capsys, monkeypatch)
    assert code == 0, err
    exported = holdout_run / "new_clients" / "hospital_b"
    result = json.loads((exported / "result.json").read_text())
    assert result["client"] == "hospital_b" and result["source"] == str(new)
    assert (result["train_samples"], result["test_samples"]) == (len(client.train), len(client.test))
    global_state = session.model.load_pretrained(holdout_run / "global")
    assert result["before"]["local_test"] == pytest.approx(session.trainer.score(global_state, client.test))
    personal = session.model.load_pretrained(exported)
    assert session.trainer.score(personal, client.test) == pytest.approx(result["after"]["local_test"])

    # One folder of classes: a quarter of the images become its test split.
    mixed = tmp_path / "clinic"
    write_imagefolder(mixed, client.train.images[:20], client.train.labels[:20])
    code, _, err = run_cli(["personalize", "--run", str(holdout_run), "--new-client", str(mixed)], capsys, monkeypatch)
    assert code == 0, err
    result = json.loads((holdout_run / "new_clients" / "clinic" / "result.json").read_text())
    assert (result["train_samples"], result["test_samples"]) == (15, 5)
    (tmp_path / "empty" / "0").mkdir(parents=True)
    code, _, err = run_cli(
        ["personalize", "--run", str(holdout_run), "--new-client", str(tmp_path / "empty")], capsys, monkeypatch
    )
    assert code == 2 and "no images" in err


def test_a_multi_label_run_scores_new_clients_by_auc(tmp_path, home, capsys, monkeypatch):
    """CheXpert: the held-out client is scored by AUC; class folders and OOD class sets do not fit and are refused."""
    from peradapt.data import chexpert as chexpert_module

    from .test_officehome_chexpert import file_args, write_chexpert

    write_chexpert(tmp_path / "data")
    monkeypatch.setattr(chexpert_module, "RARE_COMBINATION_IMAGES", 4)
    weights = home / "backbones" / f"fmnist-{TINY_BACKBONE}.safetensors"
    run = tmp_path / "run"
    extra = ("--partition", "dir:1", "--clients", "3", "--clients-per-round", "2", "--holdout-clients", "1")
    code, _, err = run_cli(file_args("chexpert", tmp_path / "data", run, weights, *extra), capsys, monkeypatch)
    assert code == 0, err
    code, out, err = run_cli(["personalize", "--run", str(run), "--new-client", "2"], capsys, monkeypatch)
    assert code == 0, err
    result = json.loads((run / "new_clients" / "2" / "result.json").read_text())
    assert result["metric"] == "auc" and "local-test AUC" in out
    for args in (
        ["eval", "--run", str(run), "--ood", "fmnist-c"],
        ["personalize", "--run", str(run), "--new-client", str(tmp_path)],
    ):
        code, _, err = run_cli(args, capsys, monkeypatch)
        assert code == 2 and "multi-label" in err and len(err.strip().splitlines()) == 1
