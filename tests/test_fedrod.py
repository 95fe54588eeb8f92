"""FedRoD and the engine's second head: the head is zero at start, trains, travels in every export and reloads; one
client step against a hand computation of Balanced Softmax + the personal head's empirical risk in plain torch;
the server's weighted mean; the command line (train, eval, personalize, --engine flower)."""

from __future__ import annotations

import json

import numpy as np
import peft
import pytest
import timm
import torch
from rich.console import Console
from safetensors.torch import load_file
from torch import nn
from torch.testing import assert_close

import peradapt.federation.engine as engine
from peradapt.adapters import inject_adapters
from peradapt.backbones import create_backbone, freeze
from peradapt.commands.finished_run import open_run
from peradapt.compute.costs import elements
from peradapt.compute.trainer import InputPipeline, LocalTrainer
from peradapt.config import TrainConfig
from peradapt.data import ClientData, ImageSet
from peradapt.errors import ConfigError, WeightsError
from peradapt.methods import ClientUpdate, MethodContext
from peradapt.methods.base import PERSONAL_KEY
from peradapt.methods.fedrod import FedRoD
from peradapt.rundir.store import ClientStore

from .conftest import TINY_BACKBONE, measured_counts, method_config
from .test_cli import expect_user_error, run_cli, tiny_args
from .test_perada import BATCH, SIZE, TOL, normalized

pytestmark = pytest.mark.usefixtures("one_thread")

LR, PERSONAL_LR = 0.1, 0.3
CLASSES = 3
HEAD = ("personal_head.weight", "personal_head.bias")  # with --adapter none, the head's keys in the state
GENERIC = ("fc.weight", "fc.bias")


def plain_network() -> nn.Module:
    """The tiny ResNet as timm makes it, every parameter trainable: what the hand computations run on."""
    torch.manual_seed(0)
    return create_backbone(TINY_BACKBONE, num_classes=CLASSES, in_chans=1)


def rod_trainer(kind: str = "none", scope: str = "full") -> LocalTrainer:
    """The same network in peradapt (whole network trainable unless `scope` is adapter), with the second head."""
    torch.manual_seed(0)
    model = inject_adapters(
        freeze(create_backbone(TINY_BACKBONE, num_classes=CLASSES, in_chans=1)),
        kind,
        dropout=0.0,
        lora_rank=2,
        scope=scope,
    )
    model.add_personal_head()
    return LocalTrainer(model, InputPipeline(mean=(0.5,), std=(0.5,), device=torch.device("cpu")), batch_size=BATCH)


def build(trainer: LocalTrainer, initial, clients=(), **config) -> FedRoD:
    settings = {"method": "fedrod", "local_epochs": 1, "personal_epochs": 1, "lr": LR, "personal_lr": PERSONAL_LR}
    shared, own = method_config(FedRoD, **{**settings, **config})
    return FedRoD(MethodContext(shared, trainer, ClientStore(), initial, None, clients, settings=own))


def random_state(trainer: LocalTrainer, seed: int, scale: float = 0.3) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    state = trainer.model.state()
    for name in trainer.model.trainable_parameters():
        state[name] = state[name] + scale * torch.randn(state[name].shape, generator=generator)
    return state


def labeled_images(count: int, seed: int, labels: list[int]) -> ImageSet:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (count, 1, SIZE, SIZE), dtype=torch.uint8, generator=generator)
    return ImageSet(images, torch.tensor(labels), num_classes=CLASSES)


def client(client_id: int, data: ImageSet) -> ClientData:
    indices = np.arange(len(data))
    return ClientData(client_id, data, data, indices, indices)


def split(state, keys):
    return {k: v for k, v in state.items() if k in keys}, {k: v for k, v in state.items() if k not in keys}


# ---------------------------------------------------------------- the second head in the model


def test_second_head_is_zero_at_start_and_adds_its_logits_to_the_classifiers():
    trainer = rod_trainer()
    state = trainer.model.state()
    assert set(trainer.model.personal_head_keys.items()) == set(zip(HEAD, GENERIC, strict=True))
    assert state["personal_head.weight"].shape == state["fc.weight"].shape
    assert all(torch.count_nonzero(state[k]) == 0 for k in HEAD)
    assert set(HEAD) <= trainer.model.trainable_parameters().keys()
    images = labeled_images(BATCH, seed=1, labels=[0] * BATCH).images
    network = plain_network().eval()
    with torch.no_grad():
        generic = network(normalized(images))
    # At start the model is the network alone: the zero head adds nothing.
    assert_close(trainer.logits(state, labeled_images(BATCH, 1, [0] * BATCH)), generic, **TOL)

    # With a head W, b: logits are fc(h) + W h + b, h the classifier's input.
    state = random_state(trainer, seed=2)
    network.load_state_dict({k: v for k, v in state.items() if k not in HEAD})
    with torch.no_grad():
        features = network.forward_head(network.forward_features(normalized(images)), pre_logits=True)
        expected = network.fc(features) + features @ state[HEAD[0]].T + state[HEAD[1]]
    assert_close(trainer.logits(state, labeled_images(BATCH, 1, [0] * BATCH)), expected, **TOL)
    trainer.model.load_state(state)
    trainer.model.eval()
    generic_logits, personal_logits = trainer.model.split_logits(trainer.inputs(images))
    assert_close(generic_logits, network.fc(features), **TOL)
    assert_close(personal_logits, features @ state[HEAD[0]].T + state[HEAD[1]], **TOL)
    assert trainer.model.num_backbone() == sum(p.numel() for p in network.parameters())  # the head is no backbone


@pytest.mark.parametrize(("kind", "scope"), [("residual", "adapter"), ("none", "full")])
def test_second_head_travels_in_exports_and_reloads_to_the_same_logits(kind, scope, tmp_path):
    trainer = rod_trainer(kind, scope)
    model = trainer.model
    state = random_state(trainer, seed=3)
    data = labeled_images(BATCH, 4, [0] * BATCH)
    expected = trainer.logits(state, data)
    model.save_pretrained(tmp_path / "client", state)
    saved = load_file(str(tmp_path / "client" / model.weights_file))
    head_keys = list(model.personal_head_keys)
    assert all(torch.equal(saved[k], state[k]) for k in head_keys)
    assert model.saved_files(state)[model.weights_file] == (tmp_path / "client" / model.weights_file).read_bytes()

    fresh = rod_trainer(kind, scope)  # as `eval --run` and `personalize` rebuild the model
    assert_close(fresh.model.load_pretrained(tmp_path / "client"), state)
    assert_close(fresh.logits(fresh.model.state(), data), expected, **TOL)
    if kind == "none":
        return
    # Plain PEFT: a backbone with a `personal_head` module loads it too; without one, PEFT skips it (the generic
    # model). The head's logits are added by hand here.
    with torch.no_grad():
        inputs = trainer.inputs(data.images)
        backbone = plain_network()
        backbone.load_state_dict(model.backbone_state())
        generic = peft.PeftModel.from_pretrained(backbone, str(tmp_path / "client")).eval()(inputs)
        backbone = plain_network()
        backbone.load_state_dict(model.backbone_state())
        backbone.personal_head = nn.Linear(backbone.fc.in_features, CLASSES)
        personalized = peft.PeftModel.from_pretrained(backbone, str(tmp_path / "client")).eval()
        head = personalized.get_base_model().personal_head
        assert torch.equal(head.weight, state["base_model.model.personal_head.weight"])
        features = personalized.get_base_model().forward_head(
            personalized.get_base_model().forward_features(inputs), pre_logits=True
        )
        assert_close(generic + head(features), expected, **TOL)
        state_without_head = {**state, **{k: torch.zeros_like(state[k]) for k in head_keys}}
        assert_close(generic, trainer.logits(state_without_head, data), **TOL)


def test_an_adapter_without_the_head_does_not_fit_a_model_with_one(tmp_path):
    torch.manual_seed(0)
    plain = inject_adapters(
        freeze(create_backbone(TINY_BACKBONE, num_classes=CLASSES, in_chans=1)), "residual", dropout=0.0, lora_rank=2
    )
    plain.save_pretrained(tmp_path / "plain", plain.state())
    with pytest.raises(WeightsError, match="does not fit"):
        rod_trainer("residual", "adapter").model.load_pretrained(tmp_path / "plain")
    network = timm.create_model(TINY_BACKBONE, num_classes=CLASSES, in_chans=1)
    network.load_state_dict(rod_trainer().model.backbone_state())  # strict: the exported backbone has no head


# ---------------------------------------------------------------- one client step and one server step


def hand_fedrod_step(start, data, phi):
    """One full-batch step of FedRoD by autograd on the plain network and a plain head (W, b) = `phi`:
    Balanced Softmax -log(n_y e^{g_y} / sum_c n_c e^{g_c}) for the network, cross-entropy of g + W h + b for the
    head, with g and h constants there. Returns the network's new state (BatchNorm statistics of the batch
    included) and the head's."""
    network = plain_network()
    network.load_state_dict({k: v for k, v in start.items() if k not in HEAD})
    network.train()
    x, y = normalized(data.images), data.labels
    features = network.forward_head(network.forward_features(x), pre_logits=True)
    g = network.fc(features)
    counts = torch.bincount(y, minlength=CLASSES).float()
    weighted = counts * torch.exp(g)
    balanced = -torch.log(weighted[torch.arange(len(y)), y] / weighted.sum(1)).mean()
    weight, bias = (phi[k].clone().requires_grad_(True) for k in HEAD)
    personalized = g.detach() + features.detach() @ weight.T + bias
    empirical = -torch.log_softmax(personalized, 1)[torch.arange(len(y)), y].mean()
    names = [n for n, _ in network.named_parameters()]
    body_grads = torch.autograd.grad(balanced, list(network.parameters()))
    head_grads = torch.autograd.grad(empirical, [weight, bias])
    expected = {k: v.detach().clone() for k, v in network.state_dict().items()}
    for name, grad in zip(names, body_grads, strict=True):
        expected[name] = start[name] - LR * grad
    head = {k: phi[k] - PERSONAL_LR * grad for k, grad in zip(HEAD, head_grads, strict=True)}
    return expected, head


def test_client_update_is_balanced_softmax_for_the_model_and_empirical_risk_for_the_head():
    trainer = rod_trainer()
    data = labeled_images(BATCH, seed=5, labels=[0, 1, 1, 0, 1, 1, 1, 0])  # class 2 absent: n_2 = 0
    initial, global_state = trainer.model.state(), random_state(trainer, seed=6)
    method = build(trainer, initial)
    phi = split(random_state(trainer, seed=7), HEAD)[0]  # a head from an earlier round
    method.store.put(4, PERSONAL_KEY, phi)

    update = method.client_update(client(4, data), global_state, seed=0)

    start = {**split(global_state, HEAD)[1], **phi}
    expected_body, expected_head = hand_fedrod_step(start, data, phi)
    assert (update.client_id, update.num_samples) == (4, BATCH)
    assert update.upload.keys() == expected_body.keys()  # everything but the personal head goes up
    assert_close(update.upload, expected_body, **TOL)
    assert_close(method.store.get(4, PERSONAL_KEY), expected_head, **TOL)
    assert set(update.metrics) == {"local_loss", "personal_loss"}


def test_a_new_clients_head_starts_at_zero_or_as_the_initial_generic_head():
    trainer = rod_trainer()
    data = labeled_images(BATCH, seed=5, labels=[0, 1, 2, 0, 1, 1, 2, 0])
    initial = random_state(trainer, seed=8)
    initial.update({k: torch.zeros_like(initial[k]) for k in HEAD})  # the session's initial state: head zero
    global_state = random_state(trainer, seed=9)
    for setting, phi in (
        ("zero", {k: initial[k] for k in HEAD}),
        ("generic", dict(zip(HEAD, (initial[k] for k in GENERIC), strict=True))),
    ):
        method = build(trainer, initial, personal_head_init=setting)
        assert_close(method.personalized(1, global_state), {**split(global_state, HEAD)[1], **phi})
        method.client_update(client(1, data), global_state, seed=0)
        start = {**split(global_state, HEAD)[1], **phi}
        assert_close(method.store.get(1, PERSONAL_KEY), hand_fedrod_step(start, data, phi)[1], **TOL)


def test_server_takes_the_sample_weighted_mean_and_keeps_the_global_head():
    trainer = rod_trainer()
    initial = trainer.model.state()
    method = build(trainer, initial)
    global_state = random_state(trainer, seed=1)
    uploads = [split(random_state(trainer, seed=s), HEAD)[1] for s in (2, 3, 4)]
    sizes = [1, 3, 6]
    updates = [ClientUpdate(i, u, n) for i, (u, n) in enumerate(zip(uploads, sizes, strict=True))]

    new_global, info = method.server_update(global_state, updates, seed=0, round_index=0)

    assert info == {} and new_global.keys() == global_state.keys()
    for key in HEAD:
        assert torch.equal(new_global[key], global_state[key])
    for key in trainer.model.trainable_parameters():
        if key not in HEAD:
            assert_close(new_global[key], (1 * uploads[0][key] + 3 * uploads[1][key] + 6 * uploads[2][key]) / 10)
    # The personalized model: the new global body and generic head with the client's own head.
    own = {k: torch.full_like(initial[k], 0.5) for k in HEAD}
    method.store.put(2, PERSONAL_KEY, own)
    assert_close(method.personalized(2, new_global), {**split(new_global, HEAD)[1], **own})
    counts = measured_counts(method, client(2, labeled_images(BATCH, 4, [0] * BATCH)), new_global)
    head = CLASSES * (trainer.model.personal_head.in_features + 1)
    # the personal head is the client's own, the rest (statistics included) is sent; one job trains everything
    assert counts == {
        "personalized": head,
        "trained": trainer.model.num_trainable(),
        "communicated": elements(new_global) - head,
    }


def test_multi_label_data_and_unknown_head_inits_are_refused():
    trainer = rod_trainer()
    multi_hot = ImageSet(torch.zeros(4, 1, SIZE, SIZE, dtype=torch.uint8), torch.zeros(4, CLASSES), num_classes=CLASSES)
    with pytest.raises(ConfigError, match="multi-label"):
        build(trainer, trainer.model.state(), clients=[client(0, multi_hot)])
    with pytest.raises(ConfigError, match="--personal-head-init"):
        build(trainer, trainer.model.state(), personal_head_init="random")


# ---------------------------------------------------------------- the command line


def test_one_round_exports_each_clients_head_and_eval_and_personalize_reload_them(
    tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    run = tmp_path / "run"
    args = tiny_args(fmnist_dir, run, "--method", "fedrod", "--rounds", "1", "--limit-samples", "400")
    code, _, err = run_cli([*args, "--holdout-clients", "1"], capsys, monkeypatch)
    assert code == 0, err
    report = json.loads((run / "report.json").read_text())
    resolved = json.loads((run / "config.json").read_text())["resolved"]
    assert report["method"] == "fedrod" and resolved["scope"] == "full" and resolved["adapter"] == "none"
    sampled = set(json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["clients"])
    global_weights = load_file(str(run / "global" / "model.safetensors"))
    assert all(torch.count_nonzero(global_weights[k]) == 0 for k in HEAD)  # the global model is the generic one
    for client_id in range(3):
        weights = load_file(str(run / "clients" / str(client_id) / "model.safetensors"))
        assert {k: v for k, v in weights.items() if k not in HEAD}.keys() == {
            k for k in global_weights if k not in HEAD
        }
        trained = any(torch.count_nonzero(weights[k]) for k in HEAD)
        assert trained == (client_id in sampled)

    code, _, err = run_cli(["eval", "--run", str(run)], capsys, monkeypatch)
    assert code == 0, err
    evaluation = json.loads((run / "eval.json").read_text())
    assert evaluation["personalized"]["local_test"] == pytest.approx(report["personalized"]["local_test"]["per_client"])
    assert evaluation["global"]["global_test"] == pytest.approx(report["global"]["global_test"])

    code, _, err = run_cli(["personalize", "--run", str(run), "--new-client", "3"], capsys, monkeypatch)
    assert code == 0, err
    session = open_run(run)
    personal = session.model.load_pretrained(run / "new_clients" / "3")
    global_state = session.model.load_pretrained(run / "global")
    assert all(torch.equal(personal[k], global_state[k]) for k in global_state if k not in HEAD)
    assert any(torch.count_nonzero(personal[k]) for k in HEAD)  # its head learned on top of the fixed global model
    result = json.loads((run / "new_clients" / "3" / "result.json").read_text())
    assert session.trainer.score(personal, session.data.clients[3].test) == pytest.approx(result["after"]["local_test"])


def test_a_bad_personal_head_init_is_one_error_line(tmp_path, fmnist_dir, capsys, monkeypatch, home):
    run = tmp_path / "run"
    args = tiny_args(fmnist_dir, run, "--method", "fedrod", "--personal-head-init", "random")
    expect_user_error(args, capsys, monkeypatch, "--personal-head-init", "zero")
    assert not run.exists()


def test_flower_nodes_build_the_same_model_and_give_the_builtin_numbers(tmp_path, fmnist_dir, monkeypatch, home):
    """The ServerApp side and two SuperNodes' ClientApps in this process (test_flower's grid, no Ray): each node
    builds its session from the run files it is sent, second head included."""
    pytest.importorskip("flwr.simulation")
    pytest.importorskip("ray")
    from flwr.supercore.task_identity import TaskIdentity

    from .test_flower import InProcessGrid, assert_same_results, settings, store_states, train_on_grid, two_supernodes

    for name, value in (("_run_id", 1), ("_task_id", 1), ("_node_id", 0)):  # test_flower's server identity
        monkeypatch.setattr(TaskIdentity, name, value)
    values = settings(fmnist_dir, tmp_path / "builtin", method="fedrod", rounds=1, limit_samples=400)
    engine.train(TrainConfig.from_flat(values), console=Console(stderr=True, quiet=True))
    flower = tmp_path / "flower"
    train_on_grid({**values, "out": str(flower), "engine": "flower"}, InProcessGrid(two_supernodes(tmp_path)))
    assert_same_results(tmp_path / "builtin", flower)
    sampled = set(json.loads((flower / "metrics.jsonl").read_text().splitlines()[0])["clients"])
    for k in range(2):  # each node keeps its own sampled clients' personal heads
        states = store_states(tmp_path / f"node{k}" / "client_store")
        assert set(states) == {(c, PERSONAL_KEY) for c in sampled if c % 2 == k}
    heads = [load_file(str(flower / "clients" / str(c) / "model.safetensors"))[HEAD[0]] for c in range(4)]
    assert {c for c, head in enumerate(heads) if torch.count_nonzero(head)} == sampled
