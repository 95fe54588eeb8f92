"""Model cards of an export (issue 17): one README.md per adapter and one for the federation, each with its own
scores from report.json and a loading recipe that works as written; `export --push-to-hub` uploads the chosen
clients with them (a stand-in for HfApi records what would be sent)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import yaml
from huggingface_hub.errors import HTTPError
from huggingface_hub.hf_api import RepoUrl
from huggingface_hub.utils import filter_repo_objects

import peradapt.commands.share as share
from peradapt.federation.session import build_session
from peradapt.rundir.layout import read_partition, read_report, read_run_config

from .test_cli import expect_refusal, run_cli, run_main, snapshot, tiny_args
from .test_dp import dp_args

pytestmark = pytest.mark.usefixtures("one_thread")

TAGS = {"peradapt", "federated-learning", "personalization"}


def train_and_export(tmp_path_factory, name: str, args: Callable[[Path], list[str]], home: Path | None):
    """(run, export) of the run `args(run)` trains."""
    root = tmp_path_factory.mktemp(name)
    run, out = root / "run", root / "export"
    run_main(args(run), home)
    run_main(["export", "--run", str(run), "--out", str(out)], home)
    return run, out


@pytest.fixture(scope="module")
def perada(tmp_path_factory, pretrained_home, fmnist_dir):
    """PerAda with residual adapters (the default for a ResNet) on a backbone `peradapt pretrain` made."""
    return train_and_export(
        tmp_path_factory, "perada", lambda run: tiny_args(fmnist_dir, run, "--rounds", "1"), pretrained_home
    )


@pytest.fixture(scope="module")
def lora(tmp_path_factory, pretrained_home, fmnist_dir):
    def args(run):
        return tiny_args(fmnist_dir, run, "--rounds", "1", "--adapter", "lora", "--method", "perada-nokd")

    return train_and_export(tmp_path_factory, "lora", args, pretrained_home)


@pytest.fixture(scope="module")
def ditto(tmp_path_factory, pretrained_home, fmnist_dir):
    """A full-model method: each client's model is the whole network, one state file."""

    def args(run):
        return tiny_args(fmnist_dir, run, "--rounds", "1", "--method", "ditto")

    return train_and_export(tmp_path_factory, "ditto", args, pretrained_home)


@pytest.fixture(scope="module")
def fedrod(tmp_path_factory, pretrained_home, fmnist_dir):
    """A second, personal head (`Method.second_head`): loaded through peradapt's AdaptedModel."""

    def args(run):
        return tiny_args(fmnist_dir, run, "--rounds", "1", "--method", "fedrod")

    return train_and_export(tmp_path_factory, "fedrod", args, pretrained_home)


@pytest.fixture(scope="module")
def private(tmp_path_factory, fmnist_dir, vit_weights):
    """DP-SGD on a tiny ViT (LoRA) from a --weights file, the last of 4 clients held out."""
    return train_and_export(
        tmp_path_factory, "dp", lambda run: dp_args(fmnist_dir, vit_weights, run, "--rounds", "1"), None
    )


def card(path: Path) -> tuple[dict, str]:
    """A README.md's front matter (parsed as YAML) and its body."""
    return card_text(path.read_text(encoding="utf-8"))


def card_text(text: str) -> tuple[dict, str]:
    match = re.match(r"---\n(.*?)\n---\n(.*)", text, re.DOTALL)
    assert match, text[:200]
    return yaml.safe_load(match.group(1)), match.group(2)


def report_of(run: Path) -> dict:
    return json.loads((run / "report.json").read_text())


def percent(value: float) -> str:
    return f"{100 * value:.2f}%"


def snippet(body: str) -> str:
    (code,) = re.findall(r"```python\n(.*?)```", body, re.DOTALL)
    return code


def load_as_the_card_says(body: str, root: Path, monkeypatch) -> dict:
    """Run the card's Python code from the export's directory (as its `root = "."` expects); its names."""
    monkeypatch.chdir(root)
    namespace: dict = {}
    exec(compile(snippet(body), "README.md", "exec"), namespace)
    return namespace


def expected_logits(run: Path, client: int | None, count: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Test images of `client` (uint8) and the logits peradapt's own evaluation gives them with the exported
    adapter of `client` (None: the global adapter)."""
    config, _ = read_run_config(run)
    session = build_session(config, read_partition(run))
    who = 0 if client is None else client
    state = session.model.load_pretrained(run / ("global" if client is None else f"clients/{client}"))
    test = session.data.clients[who].test.subset(torch.arange(count))
    return test.images, session.trainer.logits(state, test)


# ---------------------------------------------------------------- what a card says


def test_each_client_card_names_its_client_and_its_own_scores(perada):
    run, out = perada
    report = report_of(run)
    local = report["personalized"]["local_test"]["per_client"]
    global_test = report["personalized"]["global_test"]["per_client"]
    own = {}
    for index, client in enumerate(report["clients"]):
        _, body = card(out / "clients" / str(client) / "README.md")
        assert f"# Client {client}:" in body
        assert f"| client {client}'s test split (local-test) | {percent(local[index])} |" in body
        assert f"| all clients' test data (global-test) | {percent(global_test[index])} |" in body
        own[client] = percent(local[index])
    assert len(set(own.values())) > 1  # different clients, different numbers: each card has its own


def test_the_global_card_has_the_global_models_scores(perada):
    run, out = perada
    report = report_of(run)
    _, body = card(out / "global" / "README.md")
    assert body.startswith("\n# Global adapter of a perada federation on fmnist")
    assert f"| all clients' test data (global-test) | {percent(report['global']['global_test'])} |" in body
    stats = report["global"]["local_test"]
    assert f"{100 * stats['mean']:.2f} ± {100 * stats['std']:.2f}%" in body


def test_front_matter_is_yaml_for_the_hub(perada, lora, ditto):
    for out, method, kind, library in (
        (perada[1], "perada", "residual-adapter", "peft"),
        (lora[1], "perada-nokd", "lora", "peft"),
        (ditto[1], "ditto", "full-model", "timm"),  # no adapter: one state file of the whole network
    ):
        for path in (out / "README.md", out / "global" / "README.md", out / "clients" / "1" / "README.md"):
            metadata, _ = card(path)
            assert metadata["library_name"] == library
            assert set(metadata["tags"]) == TAGS | {method, kind}
            # weights made by `peradapt pretrain`: no Hub model to name, no license known
            assert "base_model" not in metadata and "license" not in metadata


def test_cards_say_where_the_backbone_weights_came_from(perada):
    run, out = perada
    _, resolved = read_run_config(run)
    _, body = card(out / "clients" / "0" / "README.md")
    assert "peradapt pretrain on fmnist" in body  # the description kept beside the run's pinned weights
    assert f"from `{Path(resolved.weights).name}`" in body and resolved.backbone_sha256 in body
    assert "`dir:0.5` over 4 clients" in body and "1 round, 2 of 4 clients sampled per round, seed 0" in body


def test_residual_cards_say_peradapt_is_needed_and_lora_cards_do_not_call_it_a_custom_layer(perada, lora):
    _, residual = card(perada[1] / "clients" / "0" / "README.md")
    _, low_rank = card(lora[1] / "clients" / "0" / "README.md")
    assert "custom PEFT layer" in residual and "registers the residual adapter" in residual
    assert "custom PEFT layer" not in low_rank and "residual" not in low_rank
    assert "PEFT LoRA of rank 8" in low_rank
    # the tiny backbone of the tests is a narrow ResNet that peradapt registers with timm: said as the reason
    assert "registers resnet10_w4 with timm" in low_rank


def test_the_run_directory_keeps_no_model_card_templates(perada):
    run, _ = perada
    assert not list(run.glob("clients/*/README.md")) and not (run / "global" / "README.md").exists()


def test_a_dp_card_gives_that_clients_epsilon_and_held_out_clients_get_none(private):
    run, out = private
    report = report_of(run)
    epsilons = report["privacy"]["epsilon"]["per_client"]
    assert report["clients"] == [0, 1, 2] and report["held_out_clients"] == [3]
    for index, client in enumerate(report["clients"]):
        _, body = card(out / "clients" / str(client) / "README.md")
        assert f"ε = {epsilons[index]:.2f} for this client's data at δ = 1e-05" in body
    assert not (out / "clients" / "3").exists()
    _, federation = card(out / "README.md")
    assert "1 client (3) were held out of training" in federation
    metadata, body = card(out / "global" / "README.md")
    assert f"at most {report['privacy']['epsilon']['max']:.2f}" in body
    assert metadata["tags"][-1] == "lora"  # the default adapter of a ViT
    assert f"from `{Path(read_run_config(run)[1].weights).name}`" in body  # --weights FILE, by its name


# ---------------------------------------------------------------- the loading recipe works as written


@pytest.mark.parametrize(
    ("name", "client"), [("perada", 2), ("perada", None), ("lora", 1), ("ditto", 3), ("fedrod", 1)]
)
def test_the_cards_code_loads_the_model_peradapt_evaluated(name, client, request, monkeypatch, home):
    run, out = request.getfixturevalue(name)
    _, body = card(out / ("global" if client is None else f"clients/{client}") / "README.md")
    namespace = load_as_the_card_says(body, out, monkeypatch)
    images, expected = expected_logits(run, client)
    with torch.no_grad():
        actual = namespace["model"](namespace["preprocess"](images))
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_the_dp_vit_card_loads_with_plain_peft(private, monkeypatch):
    run, out = private
    _, body = card(out / "clients" / "1" / "README.md")
    assert "import peradapt" in body  # vit_tiny_p4_32 is peradapt's
    namespace = load_as_the_card_says(body, out, monkeypatch)
    images, expected = expected_logits(run, 1, count=8)
    with torch.no_grad():
        torch.testing.assert_close(namespace["model"](namespace["preprocess"](images)), expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- --push-to-hub


class StandInApi:
    """Records what `HfApi` would send: the repositories created, and per upload the files it would take."""

    calls: ClassVar[list[tuple[str, dict]]] = []
    fail: ClassVar[Exception | None] = None

    def create_repo(self, repo_id: str, **kwargs):
        if StandInApi.fail is not None:
            raise StandInApi.fail
        StandInApi.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, *, folder_path, allow_patterns=None, delete_patterns=None, **kwargs):
        root = Path(folder_path)
        files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
        sent = list(filter_repo_objects(files, allow_patterns=allow_patterns))
        deleted = delete_patterns
        StandInApi.calls.append(("upload_folder", {"files": sent, "delete_patterns": deleted, **kwargs}))


@pytest.fixture
def hub(monkeypatch):
    StandInApi.calls, StandInApi.fail = [], None
    monkeypatch.setattr(share, "HfApi", StandInApi)
    monkeypatch.setattr(share, "get_token", lambda: "hf_stand_in")
    return StandInApi


def test_push_uploads_the_chosen_clients_with_their_cards(perada, tmp_path, hub, capsys, monkeypatch, home):
    run, _ = perada
    out = tmp_path / "shared"
    args = ["export", "--run", str(run), "--out", str(out), "--push-to-hub", "someone/fmnist-perada"]
    code, printed, err = run_cli([*args, "--clients", "2,0", "--private"], capsys, monkeypatch)
    assert code == 0, err
    assert "uploaded to https://huggingface.co/someone/fmnist-perada" in printed
    (create, created), (upload, uploaded) = hub.calls
    assert create == "create_repo" and created["repo_id"] == "someone/fmnist-perada"
    assert created["exist_ok"] is True and created["private"] is True and created["repo_type"] == "model"
    assert upload == "upload_folder" and uploaded["repo_id"] == "someone/fmnist-perada"
    sent = uploaded["files"]
    assert {f.split("/")[1] for f in sent if f.startswith("clients/")} == {"0", "2"}  # only the chosen clients
    assert {"README.md", "backbone.safetensors", "backbone.json", "global/README.md"} <= set(sent)
    for client in (0, 2):
        assert {f"clients/{client}/{name}" for name in ("README.md", "adapter_model.safetensors")} <= set(sent)
    assert "clients/*" in uploaded["delete_patterns"]  # an earlier push's other clients go
    _, federation = card(out / "README.md")
    assert "[`someone/fmnist-perada`](https://huggingface.co/someone/fmnist-perada)" in federation
    assert "personalized adapters of 2 clients (0, 2)" in federation

    # a card's recipe downloads what it needs from the repository: here, the export stands in for the download
    _, body = card(out / "clients" / "2" / "README.md")
    assert 'snapshot_download("someone/fmnist-perada", allow_patterns=["backbone*", "clients/2/*"])' in body
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, allow_patterns: str(out))
    namespace: dict = {}
    exec(compile(snippet(body), "README.md", "exec"), namespace)
    images, expected = expected_logits(run, 2, count=4)
    with torch.no_grad():
        torch.testing.assert_close(namespace["model"](namespace["preprocess"](images)), expected, atol=1e-5, rtol=1e-5)


def test_push_of_all_clients(perada, tmp_path, hub, capsys, monkeypatch, home):
    run, _ = perada
    args = ["export", "--run", str(run), "--out", str(tmp_path / "x"), "--push-to-hub", "someone/all"]
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    (_, created), (_, uploaded) = hub.calls
    assert created["private"] is None  # a new repository gets the Hub's default visibility
    assert {f.split("/")[1] for f in uploaded["files"] if f.startswith("clients/")} == {"0", "1", "2", "3"}


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--clients", "99"], ["--clients 99", "no client 99", "0-3"]),
        (["--clients", "0,x"], ["'x' is no client id"]),
        (["--clients", ""], ["is no client id"]),
    ],
)
def test_bad_clients_are_refused_before_anything_is_written_or_sent(
    extra, needles, perada, tmp_path, hub, capsys, monkeypatch, home
):
    run, _ = perada
    out = tmp_path / "x"
    args = ["export", "--run", str(run), "--out", str(out), "--push-to-hub", "someone/x", *extra]
    expect_refusal(args, capsys, monkeypatch, *needles, untouched=out)
    assert hub.calls == []


def test_a_held_out_client_is_refused_with_what_to_do(private, tmp_path, hub, capsys, monkeypatch):
    run, _ = private
    out = tmp_path / "x"
    args = ["export", "--run", str(run), "--out", str(out), "--push-to-hub", "someone/x", "--clients", "3"]
    expect_refusal(args, capsys, monkeypatch, "held out", "peradapt personalize", untouched=out)
    assert hub.calls == []


def test_push_without_a_token_or_with_a_bad_repo_id_says_what_to_do(perada, tmp_path, hub, capsys, monkeypatch, home):
    run, _ = perada
    out = tmp_path / "x"
    base = ["export", "--run", str(run), "--out", str(out)]
    expect_refusal([*base, "--push-to-hub", "no-owner"], capsys, monkeypatch, "OWNER/NAME", untouched=out)
    expect_refusal([*base, "--clients", "0"], capsys, monkeypatch, "--push-to-hub", untouched=out)
    monkeypatch.setattr(share, "get_token", lambda: None)
    expect_refusal(
        [*base, "--push-to-hub", "someone/x"], capsys, monkeypatch, "hf auth login", "HF_TOKEN", untouched=out
    )
    assert hub.calls == []


def test_an_unreachable_hub_is_one_error_line_and_the_export_stays(perada, tmp_path, hub, capsys, monkeypatch, home):
    run, _ = perada
    out = tmp_path / "x"
    hub.fail = HTTPError("[Errno -2] Name or service not known")
    args = ["export", "--run", str(run), "--out", str(out), "--push-to-hub", "someone/x"]
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 2
    (line,) = err.strip().splitlines()
    assert line.startswith("error: cannot upload to someone/x") and "no network connection?" in line
    assert str(out) in line and (out / "README.md").is_file()  # what to upload later is there
    assert snapshot(out) is not None and os.listdir(out)


@pytest.mark.parametrize(
    ("backbone", "kind", "weights", "base_model", "license_"),
    [
        (
            "resnet18.tv_in1k",
            "lora",
            "Hugging Face Hub timm/resnet18.tv_in1k (cached file /c)",
            "timm/resnet18.tv_in1k",
            "bsd-3-clause",
        ),
        (
            "resnet18.tv_in1k",
            "residual",
            "Hugging Face Hub timm/resnet18.tv_in1k (fetched)",
            "timm/resnet18.tv_in1k",
            "bsd-3-clause",
        ),
        ("resnet18.tv_in1k", "lora", "/weights/mine.safetensors", None, None),  # --weights: not the Hub's
        (
            "hf:google/vit-base-patch16-224",
            "lora",
            "/hf/hub/models--google--vit-base-patch16-224/snapshots/a",
            "google/vit-base-patch16-224",
            None,
        ),
        ("hf:/models/mine", "lora", "/models/mine", None, None),  # a save_pretrained directory
    ],
)
def test_hub_backbones_are_the_base_model(backbone, kind, weights, base_model, license_, perada):
    from peradapt.commands.cards import RunCards

    run, _ = perada
    config, resolved = read_run_config(run)
    config.backbone.backbone = backbone
    config.backbone.weights = weights if weights.startswith("/weights") else None
    resolved = dataclasses.replace(resolved, adapter=kind, weights=weights)
    cards = RunCards(config, resolved, read_report(run))
    metadata, body = card_text(cards.adapter(0))
    assert metadata.get("base_model") == base_model and metadata.get("license") == license_
    assert metadata["library_name"] == "peft"
    if backbone.startswith("hf:"):
        assert 'AutoModelForImageClassification.from_pretrained(f"{root}/backbone")' in body
    else:  # a timm model of timm's own: peradapt only for the residual adapter, a custom PEFT layer
        assert 'timm.create_model("resnet18.tv_in1k", num_classes=10, in_chans=1)' in body
    assert ("import peradapt" in body) == (kind == "residual")


# ---------------------------------------------------------------- what anyone can use (issue 25)


def text_files(root: Path) -> dict[Path, str]:
    """Every file of an export that reads as UTF-8 text (cards, configs), by path."""
    texts = {}
    for path in root.rglob("*"):
        if path.is_file():
            try:
                texts[path] = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue  # safetensors
    return texts


def test_runs_record_their_class_names(perada, capsys, monkeypatch):
    from peradapt.data.sources import FMNIST_CLASSES

    run, _ = perada
    assert read_run_config(run)[1].classes == list(FMNIST_CLASSES)
    assert report_of(run)["classes"] == list(FMNIST_CLASSES)
    code, stdout, _ = run_cli(["info", "--run", str(run)], capsys, monkeypatch)
    assert code == 0 and f"classes: {', '.join(FMNIST_CLASSES)}" in stdout


@pytest.mark.parametrize("merge", [False, True])
def test_an_export_holds_no_path_of_the_machine_it_was_made_on(merge, perada, tmp_path, home, fmnist_dir):
    run, _ = perada
    out = tmp_path / "export"
    run_main(["export", "--run", str(run), "--out", str(out), *(["--merge"] if merge else [])], home)
    _, resolved = read_run_config(run)
    machine = {str(p) for p in (run, run.resolve(), fmnist_dir, home, tmp_path.parent, Path(resolved.weights))}
    texts = text_files(out)
    assert any(path.suffix == ".json" for path in texts) and any(path.name == "README.md" for path in texts)
    for path, text in texts.items():
        leaked = [where for where in machine if where in text]
        assert not leaked, f"{path} holds {leaked}"
    _, body = card(out / "clients" / "0" / "README.md")
    # the weights named by their file and fingerprint, not their path
    assert f"from `{Path(resolved.weights).name}`" in body and resolved.backbone_sha256 in body


def test_cards_carry_model_index_datasets_and_license_for_the_hub(perada, tmp_path, home):
    from huggingface_hub import ModelCard

    from peradapt.data.sources import FMNIST_CLASSES

    run, _ = perada
    out = tmp_path / "export"
    run_main(["export", "--run", str(run), "--out", str(out), "--license", "cc-by-4.0"], home)
    report = report_of(run)
    for client in (0, 2):
        parsed = ModelCard.load(out / "clients" / str(client) / "README.md")
        assert parsed.data.license == "cc-by-4.0" and parsed.data.datasets == ["zalando-datasets/fashion_mnist"]
        local, everyone = parsed.data.eval_results
        assert (local.metric_type, local.task_type) == ("accuracy", "image-classification")
        index = report["clients"].index(client)
        assert local.metric_value == round(100 * report["personalized"]["local_test"]["per_client"][index], 2)
        assert everyone.metric_value == round(100 * report["personalized"]["global_test"]["per_client"][index], 2)
        assert (local.dataset_split, everyone.dataset_split) == ("local-test", "global-test")  # apart on the Hub
    global_card = ModelCard.load(out / "global" / "README.md")
    assert global_card.data.eval_results[0].metric_value == round(100 * report["global"]["global_test"], 2)
    federation = ModelCard.load(out / "README.md")
    assert federation.data.eval_results[0].metric_value == round(100 * report["personalized"]["local_test"]["mean"], 2)
    _, body = card(out / "clients" / "0" / "README.md")
    assert ", ".join(FMNIST_CLASSES) in body  # the order of the logits
    backbone = json.loads((out / "backbone.json").read_text())
    assert backbone["classes"] == list(FMNIST_CLASSES)


def test_a_bad_license_is_refused_before_anything_is_written(perada, tmp_path, capsys, monkeypatch, home):
    run, _ = perada
    out = tmp_path / "export"
    args = ["export", "--run", str(run), "--out", str(out), "--license", "Apache 2"]
    expect_refusal(args, capsys, monkeypatch, "--license", "apache-2.0", untouched=out)


# A fresh interpreter in which peradapt cannot be imported, as on the machine of someone who downloaded a model.
WITHOUT_PERADAPT = """
import importlib.abc
import sys


class NoPeradapt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "peradapt" or name.startswith("peradapt."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None


sys.meta_path.insert(0, NoPeradapt())
"""


def run_without_peradapt(code: str, directory: Path) -> str:
    """Run `code` in a fresh Python process, from `directory`, where peradapt is not importable; its stdout."""
    import subprocess
    import sys

    script = directory.parent / f".{directory.name}-check.py"
    script.write_text(WITHOUT_PERADAPT + code, encoding="utf-8")
    try:
        done = subprocess.run(
            [sys.executable, str(script)], cwd=directory, capture_output=True, text=True, timeout=300, check=False
        )
    finally:
        script.unlink()
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def merged_export(run: Path, out: Path, home: Path) -> Path:
    run_main(["export", "--run", str(run), "--out", str(out), "--merge"], home)
    return out


def test_a_merged_model_loads_without_peradapt_with_the_same_logits(perada, tmp_path, home):
    run, _ = perada
    target = merged_export(run, tmp_path / "merged", home) / "clients" / "2"
    assert sorted(p.name for p in target.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    metadata, body = card(target / "README.md")
    assert metadata["library_name"] == "timm" and "merged" in metadata["tags"]
    assert "import peradapt" not in body and "**merged**" in body
    images, expected = expected_logits(run, 2)
    torch.save(images, tmp_path / "images.pt")
    check = f"""
{snippet(body)}
images = torch.load({str(tmp_path / "images.pt")!r})
with torch.no_grad():
    logits = model(preprocess(images))
    by_timm = timm.create_model("local-dir:.", pretrained=True).eval()(preprocess(images))
assert "peradapt" not in sys.modules
print(json.dumps([logits.tolist(), by_timm.tolist(), classes]))
"""
    logits, by_timm, classes = json.loads(run_without_peradapt(check, target))
    torch.testing.assert_close(torch.tensor(logits), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(by_timm), expected, atol=1e-4, rtol=1e-4)
    assert classes == report_of(run)["classes"]


@pytest.mark.parametrize(("name", "client"), [("fedrod", 1), ("lora", None)])
def test_merged_personal_heads_and_lora_give_the_models_logits(name, client, request, tmp_path, monkeypatch, home):
    run, _ = request.getfixturevalue(name)
    out = merged_export(run, tmp_path / "merged", home)
    target = out / ("global" if client is None else f"clients/{client}")
    _, body = card(target / "README.md")
    namespace = load_as_the_card_says(body, target, monkeypatch)  # timm alone builds it (checked above)
    images, expected = expected_logits(run, client)
    with torch.no_grad():
        torch.testing.assert_close(namespace["model"](namespace["preprocess"](images)), expected, atol=1e-4, rtol=1e-4)
    _, federation = card(out / "README.md")
    assert 'root = "clients/0"' in federation and "backbone.safetensors" not in federation


# ---------------------------------------------------------------- report.json's statistics of the clients (issue 28)


def test_local_test_statistics_as_by_hand():
    from peradapt.evaluation import local_test_statistics

    scores = [0.9, 0.5, float("nan"), 0.7, 0.1, 0.8, 0.6, 0.95, 0.3, 0.65, 0.75, 0.85]  # 11 defined
    sizes = [10, 20, 5, 30, 40, 10, 10, 10, 50, 10, 10, 10]
    stats = local_test_statistics(scores, sizes)
    # ceil(10% of 11) = 2 worst clients: 0.1 and 0.3
    assert stats["worst_10pct"] == pytest.approx((0.1 + 0.3) / 2)
    correct = 9 + 10 + 21 + 4 + 8 + 6 + 9.5 + 15 + 6.5 + 7.5 + 8.5  # score x size, the undefined client left out
    pooled = correct / (10 + 20 + 30 + 40 + 10 + 10 + 10 + 50 + 10 + 10 + 10)
    assert stats["weighted_mean"] == pytest.approx(pooled)
    assert local_test_statistics([0.4, 0.2], [1, 3])["worst_10pct"] == 0.2  # at least one client


def test_report_weights_each_clients_local_test_by_its_images(perada):
    run, _ = perada
    report = report_of(run)
    sizes = {client["id"]: len(client["test"]) for client in read_partition(run)["clients"]}
    for who in ("personalized", "global"):
        stats = report[who]["local_test"]
        counted = [sizes[client] for client in report["clients"]]
        correct = sum(score * size for score, size in zip(stats["per_client"], counted, strict=True))
        assert stats["weighted_mean"] == pytest.approx(correct / sum(counted))
        assert stats["worst_10pct"] == min(stats["per_client"])  # 4 clients: the worst one


def test_report_names_the_partition_it_scored_by_its_hash(perada):
    import hashlib

    run, _ = perada
    assert report_of(run)["partition_sha256"] == hashlib.sha256((run / "partition.json").read_bytes()).hexdigest()
