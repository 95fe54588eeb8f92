"""Tests for the partial-model baselines (FedBN, FedRep, FedPer, LG-FedAvg, FedAlt, FedSim): which keys are
personal, one client step and one server step against plain autograd, Table 1's parameter counts, and one CLI round
each. FedRep's and FedBABU's own schedules: tests/test_body_head.py."""

from __future__ import annotations

import json

import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.testing import assert_close

from peradapt.adapters import inject_adapters
from peradapt.backbones import create_backbone, freeze
from peradapt.commands.finished_run import open_run
from peradapt.compute.costs import elements
from peradapt.compute.trainer import InputPipeline, LocalTrainer
from peradapt.data import ImageSet
from peradapt.methods import METHODS, ClientUpdate, MethodContext
from peradapt.methods.base import PERSONAL_KEY
from peradapt.rundir.store import ClientStore

from .conftest import TINY_BACKBONE, measured_counts, method_config
from .test_cli import run_cli, tiny_args
from .test_perada import BATCH, TOL, assign, client, image_set, normalized, perturbed

LR, PERSONAL_LR = 0.1, 0.3
STEM = ["conv1.weight", "bn1.weight", "bn1.bias", "bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"]
BN_SUFFIXES = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def full_trainer(kind="none"):
    """The tiny ResNet (one basic block per stage, widths 4-32) with the whole network trainable."""
    torch.manual_seed(0)
    backbone = freeze(create_backbone("resnet10_w4", num_classes=3, in_chans=1))
    model = inject_adapters(backbone, kind, dropout=0.0, lora_rank=2, scope="full")
    pipeline = InputPipeline(mean=(0.5,), std=(0.5,), device=torch.device("cpu"))
    return LocalTrainer(model, pipeline, batch_size=BATCH)


def build(name, trainer, initial, part=None, **settings):
    values = {"local_epochs": 1, "personal_epochs": 1, "lr": LR, "personal_lr": PERSONAL_LR, **settings}
    config, own = method_config(name, method=name, personal_part=part, **values)
    return METHODS[name](MethodContext(config, trainer, ClientStore(), initial, distiller=None, settings=own))


# ---------------------------------------------------------------- which keys are personal


def bn_keys(module_name):
    return [f"{module_name}.{suffix}" for suffix in BN_SUFFIXES]


def expected_personal(part, keys):
    """Written out for resnet10_w4: a 64-channel stem, then stages layer1-4 of one block `layerN.0` each, every
    one with a downsample (the stem is wider than layer1)."""
    if part == "head":
        return {"fc.weight", "fc.bias"}
    if part == "extractor":
        return set(keys) - {"fc.weight", "fc.bias"}
    if part == "bn":
        names = ["bn1"] + [f"layer{i}.0.bn{j}" for i in range(1, 5) for j in (1, 2)]
        names += [f"layer{i}.0.downsample.1" for i in range(1, 5)]
        return {key for name in names for key in bn_keys(name)}
    if part == "input":
        blocks = [[f"layer{i}.0.conv1.weight", *bn_keys(f"layer{i}.0.bn1")] for i in range(1, 5)]
        return set(STEM) | {key for block in blocks for key in block}
    assert part == "adapter"
    prefixes = [f"base_model.model.layer{i}.0.conv{j}.lora_residual.default." for i in range(1, 5) for j in (1, 2)]
    suffixes = ["2.weight"] + [f"0.{s}" for s in BN_SUFFIXES]
    return {prefix + suffix for prefix in prefixes for suffix in suffixes}


@pytest.mark.parametrize(
    ("name", "part", "expected_part"),
    [
        ("fedbn", None, "bn"),
        ("fedrep", None, "head"),
        ("fedper", None, "head"),
        ("lg-fedavg", None, "extractor"),
        ("fedalt", None, "head"),  # output layer = head
        ("fedsim", "input", "input"),
        ("fedalt", "bn", "bn"),
        ("fedsim", "adapter", "adapter"),
    ],
)
def test_personal_and_shared_keys_partition_the_state(name, part, expected_part):
    trainer = full_trainer("residual" if part == "adapter" else "none")
    state = trainer.model.state()
    method = build(name, trainer, state, part)
    personal, shared = set(method.personal), set(method.shared)
    assert personal == expected_personal(expected_part, state)
    assert personal.isdisjoint(shared)
    assert personal | shared == state.keys()
    assert len(method.personal) + len(method.shared) == len(state)


def test_personal_part_flag_overrides_the_default_and_bad_parts_are_refused():
    trainer = full_trainer()
    state = trainer.model.state()
    assert build("fedsim", trainer, state).part == "output"
    assert build("fedrep", trainer, state, "bn").part == "bn"
    with pytest.raises(Exception, match="adapter"):
        build("fedalt", trainer, state, "adapter")  # no adapters injected


# ---------------------------------------------------------------- one client step (one full batch per phase)


def hand_step(trainer, start, data, rates):
    """One full-batch SGD step on the parameters named in `rates` (name -> learning rate), by autograd.

    Everything else keeps its `start` value, except the running statistics of BatchNorm layers whose own
    parameters train: those follow the forward pass in training mode.
    """
    module = trainer.model.module
    assign(module, start)
    module.train()
    parameters = dict(module.named_parameters())
    loss = F.cross_entropy(module(normalized(data.images)), data.labels)
    grads = torch.autograd.grad(loss, [parameters[name] for name in rates])
    after = module.state_dict()
    owners = {name.rpartition(".")[0] for name in rates}
    expected = {}
    for key, value in start.items():
        moved = key not in parameters and key.rpartition(".")[0] in owners
        expected[key] = after[key].detach().clone() if moved else value.clone()
    for (name, lr), grad in zip(rates.items(), grads, strict=True):
        expected[name] = start[name] - lr * grad
    return expected


def split(state, personal):
    return {k: v for k, v in state.items() if k in personal}, {k: v for k, v in state.items() if k not in personal}


def changed(a, b):
    return {k for k in a if not torch.equal(a[k], b[k])}


@pytest.mark.parametrize(
    ("name", "part", "alternating"),
    [
        ("fedrep", None, True),
        ("fedalt", "adapter", True),
        ("fedsim", "input", False),
        ("fedbn", None, False),
        ("lg-fedavg", None, False),
        ("fedper", None, False),  # FedSim with the head personal
    ],
)
def test_client_update_matches_hand_sgd(name, part, alternating):
    kind = "residual" if part == "adapter" else "none"
    trainer = full_trainer(kind)
    data = image_set(BATCH, seed=3)
    initial, global_state = perturbed(trainer.model, seed=1), perturbed(trainer.model, seed=2)
    method = build(name, trainer, initial, part)
    personal_keys = expected_personal(method.part, initial)
    trainable = trainer.model.trainable_parameters()
    # Client 4 was never sampled: it starts from the global shared part and the initial personal part.
    start = {k: (initial if k in personal_keys else global_state)[k] for k in initial}

    update = method.client_update(client(4, data), global_state, seed=0)

    personal_rates = {k: PERSONAL_LR for k in trainable if k in personal_keys}
    shared_rates = {k: LR for k in trainable if k not in personal_keys}
    if alternating:  # personal part with the shared part frozen, then the shared part with the new personal part
        middle = hand_step(trainer, start, data, personal_rates)
        assert changed(middle, start) and changed(middle, start) <= personal_keys
        expected = hand_step(trainer, middle, data, shared_rates)
        assert changed(expected, middle) and changed(expected, middle).isdisjoint(personal_keys)
        assert set(update.metrics) == {"personal_loss", "local_loss"}
    else:
        expected = hand_step(trainer, start, data, {**personal_rates, **shared_rates})
        assert set(update.metrics) == {"local_loss"}
    expected_personal_part, expected_upload = split(expected, personal_keys)
    assert (update.client_id, update.num_samples) == (4, BATCH)
    assert update.upload.keys() == expected_upload.keys()
    assert_close(update.upload, expected_upload, **TOL)
    assert_close(method.store.get(4, PERSONAL_KEY), expected_personal_part, **TOL)
    # Both parts moved from where they started.
    assert changed(update.upload, global_state) and changed(method.store.get(4, PERSONAL_KEY), initial)


def test_second_round_starts_from_the_stored_personal_part():
    trainer = full_trainer()
    data = image_set(BATCH, seed=3)
    initial = perturbed(trainer.model, seed=1)
    first_global, second_global = perturbed(trainer.model, seed=2), perturbed(trainer.model, seed=5)
    method = build("fedsim", trainer, initial)
    method.client_update(client(4, data), first_global, seed=0)
    head = method.store.get(4, PERSONAL_KEY)
    assert set(head) == {"fc.weight", "fc.bias"}

    update = method.client_update(client(4, data), second_global, seed=1)

    start = {**{k: v for k, v in second_global.items() if k not in head}, **head}
    rates = {k: PERSONAL_LR if k in head else LR for k in trainer.model.trainable_parameters()}
    expected = hand_step(trainer, start, data, rates)
    assert_close(method.store.get(4, PERSONAL_KEY), split(expected, head)[0], **TOL)
    assert_close(update.upload, split(expected, head)[1], **TOL)


# ---------------------------------------------------------------- server step and personalized models


@pytest.mark.parametrize(
    ("name", "aggregation", "weighted"),
    [
        ("fedper", None, True),  # Arivazhagan et al.: sum_j n_j W_B,j / n
        ("fedalt", None, True),
        ("fedrep", None, False),  # Collins et al., Algorithm 1: (1/|I^t|) sum phi_i
        ("fedrep", "samples", True),  # the authors' code on FEMNIST/Sent140, PFLlib
        ("fedper", "uniform", False),
    ],
)
def test_server_averages_only_the_shared_keys(name, aggregation, weighted):
    trainer = full_trainer()
    initial = perturbed(trainer.model, seed=1)
    method = build(name, trainer, initial, aggregation=aggregation)
    head = {"fc.weight", "fc.bias"}
    global_state = perturbed(trainer.model, seed=2)
    uploads = []
    for seed, steps in ((3, 7), (4, 1), (5, 2)):
        upload = {k: v for k, v in perturbed(trainer.model, seed=seed).items() if k not in head}
        uploads.append({k: torch.tensor(steps) if k.endswith("num_batches_tracked") else v for k, v in upload.items()})
    sizes = [1, 3, 6]
    updates = [ClientUpdate(i, u, n) for i, (u, n) in enumerate(zip(uploads, sizes, strict=True))]

    new_global, info = method.server_update(global_state, updates, seed=0, round_index=0)

    assert info == {} and new_global.keys() == global_state.keys()
    for key in global_state:
        if key in head:
            assert torch.equal(new_global[key], global_state[key])
        elif key.endswith("num_batches_tracked"):
            assert new_global[key].item() == 7  # integer counters: the first upload's
        else:
            weights = [n / 10 for n in sizes] if weighted else [1 / 3] * 3
            expected = sum(w * u[key] for w, u in zip(weights, uploads, strict=True))
            assert_close(new_global[key], expected, **TOL)
    other = [1 / 3] * 3 if weighted else [n / 10 for n in sizes]
    key = "layer1.0.conv1.weight"
    assert not torch.allclose(new_global[key], sum(w * u[key] for w, u in zip(other, uploads, strict=True)))

    # A client never sampled: new shared part, initial head. A sampled one: new shared part, its own head.
    fresh = method.personalized(0, new_global)
    assert all(torch.equal(fresh[k], (initial if k in head else new_global)[k]) for k in initial)
    own_head = {k: torch.full_like(initial[k], 0.5) for k in head}
    method.store.put(2, PERSONAL_KEY, own_head)
    mine = method.personalized(2, new_global)
    assert all(torch.equal(mine[k], (own_head if k in head else new_global)[k]) for k in initial)


# ---------------------------------------------------------------- Table 1 parameter counts (ResNet-18, 10 classes)


def conv(c_in, c_out, k=3):
    return c_in * c_out * k * k


# (method, --personal-part, Table 1 "# trained params", "# communicated params") in millions, CIFAR-10 rows.
TABLE_1 = [
    ("fedbn", None, 11.18, 11.17),
    ("fedalt", "input", 11.18, 6.45),
    ("fedsim", "input", 11.18, 6.45),
    ("lg-fedavg", None, 11.18, 0.005),
    ("fedrep", None, 11.18, 11.17),
    ("fedalt", "output", 11.18, 11.17),
    ("fedsim", "output", 11.18, 11.17),
    ("fedalt", "adapter", 12.59, 11.18),
    ("fedsim", "adapter", 12.59, 11.18),
]


@pytest.fixture(scope="module")
def resnet18_trainers():
    trainers = {}
    for kind in ("none", "residual"):
        model = inject_adapters(
            freeze(create_backbone("resnet18", 10, 3)), kind, dropout=0.3, lora_rank=8, scope="full"
        )
        trainers[kind] = LocalTrainer(model, InputPipeline((0.5,) * 3, (0.5,) * 3, torch.device("cpu")), BATCH)
    return trainers


def test_parameter_counts_reproduce_table_1(resnet18_trainers):
    full = sum(p.numel() for p in timm.create_model("resnet18", num_classes=10).parameters())
    widths = (64, 128, 256, 512)
    head = 512 * 10 + 10
    bn = 2 * (64 + sum(4 * c for c in widths) + sum(widths[1:]))  # stem, two per block, downsample
    first_convs = conv(64, 64) * 2 + sum(conv(c // 2, c) + conv(c, c) for c in widths[1:])
    inputs = conv(3, 64, 7) + 2 * 64 + first_convs + 2 * sum(2 * c for c in widths)  # stem + every block's conv1, bn1
    adapters = sum(4 * (c * c + 2 * c) for c in widths)  # 1x1 conv + BN after each of 2 convs x 2 blocks per stage
    personal = {"bn": bn, "input": inputs, "output": head, "extractor": full - head, "adapter": adapters}
    generator = torch.Generator().manual_seed(0)
    data = ImageSet(torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8, generator=generator), torch.arange(4), 10)
    for name, part, paper_trained, paper_communicated in TABLE_1:
        trainer = resnet18_trainers["residual" if part == "adapter" else "none"]
        state = trainer.model.state()
        method = build(name, trainer, state, part)
        counts = measured_counts(method, client(0, data), state)  # one client update of a round, as a run measures
        mine = personal[method.part if method.part != "head" else "output"]
        trained = full + (adapters if part == "adapter" else 0)
        # parameters as the paper counts them, and the running statistics where they are the client's or travel
        statistics = {
            k for k, t in state.items() if t.is_floating_point() and k not in trainer.model.trainable_parameters()
        }
        own = elements({k: state[k] for k in method.personal if k in statistics})
        sent = elements({k: state[k] for k in statistics if k not in method.personal})
        assert counts == {"personalized": mine + own, "trained": trained, "communicated": trained - mine + sent}, name
        # Table 1 is arithmetic on rounded layer sizes (11.18 - 0.005 printed 11.17, 11.18 + 1.41 printed 12.59
        # where 1.41M is PerAda's adapter with its own BN and head): every column, in parameters, is within 0.01M.
        assert abs(counts["trained"] / 1e6 - paper_trained) < 0.01, (name, part)
        assert abs((counts["communicated"] - sent) / 1e6 - paper_communicated) < 0.01, (name, part)
    assert round(inputs / 1e6, 2) == 4.73 and round((full - inputs) / 1e6, 2) == 6.45  # Table 7 "Input layer"
    assert round(head / 1e6, 4) == 0.0051  # "the output layer consists of 0.0051M parameters"


# ---------------------------------------------------------------- the command line, one round each


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("fedbn", ()),
        ("fedrep", ()),
        ("fedper", ()),
        ("lg-fedavg", ()),
        ("fedalt", ()),
        ("fedsim", ("--personal-part", "adapter")),
    ],
)
def test_one_round_on_the_command_line(name, extra, tmp_path, fmnist_dir, capsys, monkeypatch, home):
    run = tmp_path / "run"
    code, _, err = run_cli(
        tiny_args(fmnist_dir, run, "--method", name, "--rounds", "1", "--limit-samples", "400", *extra),
        capsys,
        monkeypatch,
    )
    assert code == 0, err
    for client_id in range(4):
        assert (run / "clients" / str(client_id)).is_dir()
    report = json.loads((run / "report.json").read_text())
    assert report["method"] == name and report["rounds"] == 1
    resolved = json.loads((run / "config.json").read_text())["resolved"]
    assert resolved["scope"] == "full"
    assert resolved["adapter"] == ("residual" if extra else "none")
    counts = report["cost"]["parameters"]  # measured: the model's own part and the sent part, statistics included
    assert counts["trained"] == resolved["trainable_parameters"]
    assert counts["personalized"] + counts["communicated"] == elements(open_run(run).initial)
    if not extra:  # a plain network (`--adapter none`): exported as the backbone and a weights file per client
        export_loads_in_plain_timm(run, tmp_path / "exported", capsys, monkeypatch)


def export_loads_in_plain_timm(run, out, capsys, monkeypatch):
    """`export` of a full-network run: the backbone file overlaid with a client's model.safetensors, loaded into a
    plain timm model, gives the logits peradapt gives for that client."""
    code, _, err = run_cli(["export", "--run", str(run), "--out", str(out)], capsys, monkeypatch)
    assert code == 0, err
    network = timm.create_model(TINY_BACKBONE, num_classes=10, in_chans=1)
    network.load_state_dict(load_file(str(out / "backbone.safetensors")))
    client_weights = load_file(str(out / "clients" / "1" / "model.safetensors"))
    assert not network.load_state_dict(client_weights, strict=False).unexpected_keys
    session = open_run(run)
    test = session.data.clients[1].test.subset(torch.arange(8))
    expected = session.trainer.logits(session.model.load_pretrained(run / "clients" / "1"), test)
    with torch.no_grad():
        actual = network.eval()(session.trainer.inputs(test.images))
    assert_close(actual, expected, atol=1e-5, rtol=1e-5)
