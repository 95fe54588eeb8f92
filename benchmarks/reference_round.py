"""One PerAda round of the authors' code (NVlabs/PerAda) against peradapt's, on the same data and device (issue 35).

    python benchmarks/reference_round.py --reference benchmarks/reference/PerAda --device cuda --json OUT.json
    python benchmarks/reference_round.py --device cpu --smoke       # toy size: checks that both sides run

`vs_reference_round` is the authors' round time divided by peradapt's (above 1: peradapt is faster), the median
over repetitions of the two rounds run interleaved (their order alternating) in this one process, after warm-up
rounds on both sides (peradapt 3: its CUDA graphs are captured by then; the authors' 1).

The reference code is not part of this repository (its licence is non-commercial): it is run, never copied. Bring
it whole and export its tree where --reference points (benchmarks/reference/ is git-ignored; on a lent GPU machine
it travels as a carried path):

    mkdir -p benchmarks/reference/PerAda
    git --git-dir=<bare clone of github.com/NVlabs/PerAda> archive HEAD | tar -x -C benchmarks/reference/PerAda
    git --git-dir=<bare clone of github.com/NVlabs/PerAda> rev-parse HEAD > benchmarks/reference/PerAda/COMMIT
    mkdir -p benchmarks/reference/fashion-mnist   # only where Debian's copy is missing (a lent GPU machine)
    cp /usr/share/datasets/fashion-mnist/*.gz benchmarks/reference/fashion-mnist/

The problem (both sides). Fashion-MNIST from Debian's IDX files, loaded by peradapt (`build_federation`, as
`peradapt train` does) with 3 equal channels at 32 px, cut to --limit-samples images per split and divided among
20 clients by the authors' balanced Dirichlet split (`dir-balanced:0.1`); round 1's 8 sampled clients
(`peradapt.seeds.sample_clients`) train in every round of both sides, so both do the same work on the same
images. Both models are ResNet-18 at 32 px (7x7 stem and max-pool, as torchvision's) with random weights (speed does
not depend on their values) and residual adapters with dropout 0.3 after each block convolution; what trains is
the adapters, the blocks' BatchNorms (bn1, bn2, the stem's bn1) and the classifier: 1,413,258 parameters on both
sides (the JSON's `trainable_parameters` of each).

The authors' round (their modules imported from --reference, nothing of theirs rewritten): `optim.Our` built as
their run.py builds it, with the settings of scripts/cifar10/perada-nokd.sh parsed by their own `parse_args`
(lambda 1, lr 0.01, batch 64, 20 clients, 8 per round, aggregation by mean), scaled down to --epochs personal and
local epochs (their script: 10 and 10) and a model made by their `get_adapter_model` without the ImageNet weights
(the lent machine has no network; "pretrain" is left out of --net). `run_one_round` as it is: for each sampled
client the server's adapters are loaded into its local model, `train_per` takes the personalized model through its
proximal epochs towards them (SGD, loss + lambda * ||v - w||^2 over all the model's parameters), `train` the local
model through its epochs, then `server_aggregation` averages the 8 local models (`FedAveraging`). Their data path
as read_partition_data sets it: a DataLoader per client over a SubsetRandomSampler, batch 64, 2 worker processes
(started anew for every epoch), no pinned memory, each image through their CIFAR-10 training transform (random flip,
4-px padded random crop, resize, ToTensor, their normalization) as a PIL image; the driver gives it the clients'
images once resized to 32 px RGB, in torchvision's CIFAR layout. On CUDA their code moves batches with
`.to("cuda")` and runs in float32 (cuDNN's default TF32 convolutions) with `cudnn.benchmark` on, as run.py sets it
(the driver turns it on for their calls only). Off CUDA (the smoke on CPU) their batches are handed over in a
wrapper whose `.to()` goes to --device, their "cuda" notwithstanding.

Left out of the authors' round, with the same left out of peradapt's: the global model's test after every round
(`test`, replaced by a no-op on the instance), the evaluation and checkpoints of every --eval-every rounds (set
beyond the rounds played), Weights & Biases (`--log_online` off; `wandb`, and `torchinfo`, which only prints
model summaries, are stubbed where not installed), and distillation: **distillation is excluded on both sides**
(the authors' aggregation "mean", the perada-nokd.sh script; peradapt's `perada-nokd`). In the authors' CIFAR-10
script only the first 30 of 200 rounds distill; the other 170 are this round.

peradapt's round: a session built by `build_session` from preset perada-cifar10 (the authors' mode: lam 2, which is
their lambda 1; lr 0.01, batch 64, residual adapters with dropout 0.3, `frozen_bn train` and `frozen_bn_statistics
local`, crop-flip on the device) with the same data, sizes and epochs, method `perada-nokd`, `eval_every 0`, the
backbone from a file of random weights. The round is what `FederatedRun.play_round` does for training:
`LocalClients.train` (with --concurrent-clients auto: on CUDA the clients that fit train at once, `ConcurrentSGD`'s
fused step replayed from CUDA graphs; on a CPU one after another) and the method's `server_update` (the mean; the
frozen BatchNorm statistics from one sampled client). Left out: the engine's progress display, the round record and
the checkpoint it writes after every round (the authors write none in such rounds).

Differences that remain, by design of each side: peradapt trains in bf16 autocast and channels-last on CUDA, the
authors in float32; peradapt augments on the device (crop of the stored 28-px image, then resized to 32 px), the
authors on the CPU in DataLoader workers; the authors' proximal term runs over every parameter, frozen ones too.
With the epochs and client data scaled down, the per-epoch costs (the authors' worker start-up) weigh more than in
their 10 + 10 epochs over 2,250 images per client.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPOSITORY = "NVlabs/PerAda"
DEFAULT_REFERENCE = Path(__file__).resolve().parent / "reference" / "PerAda"
# Fashion-MNIST's IDX files: Debian's copy, else a copy beside the reference code (where it travels with it)
DEBIAN_FMNIST = Path("/usr/share/datasets/fashion-mnist")
CARRIED_FMNIST = Path(__file__).resolve().parent / "reference" / "fashion-mnist"
# The authors' top-level packages and modules, imported from --reference (names other packages may also use).
REFERENCE_MODULES = ("optim", "models", "datasets", "aggregation", "utils", "parameters", "baseline_constants")
STUBBED_IF_MISSING = ("wandb", "torchinfo")  # imported at the top of their modules, unused in the round


@dataclass(frozen=True)
class Sizes:
    clients: int = 20  # the authors' CIFAR-10 scripts: 20 clients, 8 per round, batch 64
    clients_per_round: int = 8
    batch_size: int = 64
    epochs: int = 1  # personal and local epochs each (their scripts: 10)
    # Images per split: 4,683 in the 8 sampled clients (215 to 940 each), 154 SGD steps a round at batch 64
    limit_samples: int = 11_000
    # Untimed rounds before timing. peradapt's: a step shape's CUDA graph is captured at its 3rd use, and the
    # shapes of a group's last steps come once a round. The authors': one (cuDNN benchmarks each shape at its 1st).
    warm_up: int = 3
    reference_warm_up: int = 1
    repeats: int = 5
    workers: int = 2  # the authors' DataLoader workers (datasets/read_data.py)


SMOKE = Sizes(clients=4, clients_per_round=2, batch_size=16, limit_samples=240, warm_up=1, repeats=1)
# Measured: the smoke's 2 + 2 rounds take about 15 s on 2 CPU cores (most of it loading Fashion-MNIST)


# ---------------------------------------------------------------- the problem


def peradapt_session(sizes: Sizes, device: str, data_dir: str | None, workdir: Path):
    """peradapt's session for the problem: preset perada-cifar10 on Fashion-MNIST, without distillation."""
    from peradapt.api import training_config
    from peradapt.backbones import BackboneInfo, create_backbone, save_backbone
    from peradapt.federation.session import build_session

    weights = workdir / "resnet18-random.safetensors"
    torch.manual_seed(0)
    backbone = create_backbone("resnet18", 10, 3)
    info = BackboneInfo("resnet18", 3, 32, (0.5,) * 3, (0.25,) * 3, "random weights: speed does not depend on them")
    save_backbone(backbone.state_dict(), info, weights)
    config = training_config(
        preset="perada-cifar10",
        method="perada-nokd",  # distillation excluded, as the authors' aggregation "mean"
        data="fmnist",
        data_dir=data_dir,
        kd_data="auto",  # none is used without distillation; the preset's CIFAR-100 cannot travel
        channels=3,
        image_size=32,
        limit_samples=sizes.limit_samples,
        backbone="resnet18",
        weights=str(weights),
        clients=sizes.clients,
        clients_per_round=sizes.clients_per_round,
        batch_size=sizes.batch_size,
        local_epochs=sizes.epochs,
        personal_epochs=sizes.epochs,
        eval_every=0,
        device=device,
        seed=0,
    )
    return build_session(config)


class ClientImages(torch.utils.data.Dataset):
    """The clients' training images as torchvision's CIFAR10 holds its own (`data`: N x 32 x 32 x 3 uint8,
    `targets`), each given to `transform` as a PIL image, as CIFAR10.__getitem__ does."""

    def __init__(self, data: np.ndarray, targets: list[int], transform: Callable) -> None:
        self.data, self.targets, self.transform = data, targets, transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        return self.transform(Image.fromarray(self.data[index])), self.targets[index]


def cifar_layout(images: torch.Tensor) -> np.ndarray:
    """uint8 N x C x H x W images (grey as 3 equal channels) as 32-px RGB N x 32 x 32 x 3, resized once."""
    images = images.cpu()
    if images.shape[1] == 1:
        images = images.expand(-1, 3, -1, -1)
    resized = F.interpolate(images.float(), size=(32, 32), mode="bilinear", align_corners=False)
    return resized.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


class OnDevice:
    """A batch tensor whose `.to(...)` goes to `device`: the reference code moves batches with `.to("cuda")`,
    which this hands to the CPU (off CUDA only)."""

    def __init__(self, tensor: torch.Tensor, device: torch.device) -> None:
        self.tensor, self.device = tensor, device

    def to(self, *args: object, **kwargs: object) -> torch.Tensor:
        return self.tensor.to(self.device)


class BatchesTo:
    """A DataLoader whose batches `.to()` goes to `device` (see `OnDevice`)."""

    def __init__(self, loader: torch.utils.data.DataLoader, device: torch.device) -> None:
        self.loader, self.device = loader, device

    def __iter__(self) -> Iterator[tuple[OnDevice, OnDevice]]:
        for images, labels in self.loader:
            yield OnDevice(images, self.device), OnDevice(labels, self.device)

    def __len__(self) -> int:
        return len(self.loader)


# ---------------------------------------------------------------- the authors' code


def load_reference(root: Path) -> types.SimpleNamespace:
    """The authors' modules the round needs, imported from `root` with `root` first on sys.path; what other
    packages of the same top-level names (HF's `datasets`) had in sys.modules is put back afterwards."""
    for name in STUBBED_IF_MISSING:
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            stub = types.ModuleType(name)
            stub.__doc__ = f"stub by {Path(__file__).name}: not installed, unused in the timed round"
            stub.summary = None  # torchinfo's, only called by the models' print_summary
            sys.modules[name] = stub
    saved = {
        name: module
        for name, module in sys.modules.items()
        if name.split(".")[0] in REFERENCE_MODULES and not str(getattr(module, "__file__", "")).startswith(str(root))
    }
    for name in saved:
        del sys.modules[name]
    for name in REFERENCE_MODULES:  # their folders without __init__.py: a package of that name elsewhere would win
        folder = root / name
        if folder.is_dir() and not (folder / "__init__.py").exists():
            package = types.ModuleType(name)
            package.__path__ = [str(folder)]
            sys.modules[name] = package
    sys.path.insert(0, str(root))
    try:
        parameters = importlib.import_module("parameters")
        optim = importlib.import_module("optim")
        model_utils = importlib.import_module("models.model_utils")
        prepare_data = importlib.import_module("datasets.prepare_data")
        importlib.import_module("aggregation.averaging")  # imported inside server_aggregation at every round
    finally:
        sys.path.remove(str(root))
        sys.modules.update(saved)
    return types.SimpleNamespace(
        Our=optim.Our,
        parse_args=parameters.parse_args,
        get_adapter_model=model_utils.get_adapter_model,
        get_transform=prepare_data._get_transform,
    )


def reference_args(reference: types.SimpleNamespace, sizes: Sizes, net: str) -> argparse.Namespace:
    """Their run.py's args for scripts/cifar10/perada-nokd.sh, scaled to `sizes`, parsed by their parse_args."""
    argv = ["-dataset", "cifar10", "--pfl_algo", "our", "--net", net, "--personalized", "--project", "pfl-cifar10"]
    argv += ["--lmbda", "1.0", "--batch_size", str(sizes.batch_size), "--num_clients", str(sizes.clients)]
    argv += ["--dirichlet_alpha", "0.1", "--clients-per-round", str(sizes.clients_per_round), "--num-rounds", "200"]
    argv += ["-lr", "0.01", "--lr-decay", "1", "--decay-lr-every", "50", "--num_epochs", str(sizes.epochs)]
    argv += ["--aggregation", "mean", "--nologging", "--eval-every", str(10**9)]
    saved, sys.argv = sys.argv, ["run.py", *argv]
    try:
        return reference.parse_args()
    finally:
        sys.argv = saved


def reference_optimizer(reference: types.SimpleNamespace, session, sizes: Sizes, sampled: list[int], device):
    """`optim.Our` over the session's clients and images, as run.py builds it; its clients sampled as `sampled`
    and its per-round test of the global model a no-op (see the module's docstring)."""
    net = "resnet18_fix_adapter"  # their script's resnet18_pretrain_fix_adapter without the ImageNet download
    args = reference_args(reference, sizes, net)
    clients = session.data.clients
    with contextlib.redirect_stdout(io.StringIO()):
        transform = reference.get_transform("cifar10", is_training=True)
    data = np.concatenate([cifar_layout(client.train.images) for client in clients])
    targets = [int(label) for client in clients for label in client.train.labels.tolist()]
    dataset = ClientImages(data, targets, transform)
    starts = np.cumsum([0] + [len(client.train) for client in clients])
    train_data, test_data = {}, {}
    for u, client in enumerate(clients):
        indices = list(range(starts[u], starts[u + 1]))
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=args.batch_size,
            num_workers=sizes.workers,
            pin_memory=False,
            sampler=torch.utils.data.sampler.SubsetRandomSampler(indices),
            drop_last=False,
        )
        train_data[u] = {
            "dataloader": loader if device.type == "cuda" else BatchesTo(loader, device),
            "indices": indices,
        }
        test_data[u] = {"dataloader": None, "indices": list(client.test_indices)}  # counted at set-up, never read
    torch.manual_seed(0)
    model = reference.get_adapter_model(net=net, num_classes=10, per_dropout=args.adapter_dropout).to(device)
    ids = list(range(len(clients)))
    with contextlib.redirect_stdout(io.StringIO()):
        optimizer = reference.Our(
            args=args,
            clients={"train_users": ids, "test_users": ids},
            train_data=train_data,
            test_data=test_data,
            global_model=model,
            kd_trainset=None,
            val_dataloader=None,
            test_dataloader=None,
        )
    optimizer.sample_clients = lambda count: list(sampled)
    optimizer.test = lambda model, loader, log=False: (0.0, 0.0)  # the per-round global test: no evaluation here
    return optimizer, args


# ---------------------------------------------------------------- timing


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def cudnn_benchmark(enabled: bool) -> Iterator[None]:
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = enabled
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = saved


def interleaved(
    rounds: dict[str, Callable[[], None]], warm_up: dict[str, int], repeats: int, device: torch.device
) -> dict[str, list[float]]:
    """Seconds per round of each side, `repeats` times after `warm_up[side]` untimed rounds; each repetition
    starts with the next side, so a slow phase of the machine falls on both alike."""
    names = list(rounds)
    for index in range(max(warm_up.values())):
        for name in names:
            if index >= warm_up[name]:
                continue
            started = time.perf_counter()
            rounds[name]()
            synchronize(device)
            print(f"warm-up {index + 1}: {name} {time.perf_counter() - started:.2f} s", file=sys.stderr, flush=True)
    times: dict[str, list[float]] = {name: [] for name in names}
    for repetition in range(repeats):
        shift = repetition % len(names)
        for name in names[shift:] + names[:shift]:
            synchronize(device)
            started = time.perf_counter()
            rounds[name]()
            synchronize(device)
            times[name].append(time.perf_counter() - started)
            print(f"round {repetition + 1}: {name} {times[name][-1]:.2f} s", file=sys.stderr, flush=True)
    return times


def git_head(path: Path) -> str | None:
    """The commit of the checkout at `path`, "-dirty" when its files differ from it (a lent machine's copy of a
    working tree may sit on another commit's git metadata: the suffix says the number is not the tree's)."""
    command = ["git", "-C", str(path), "describe", "--always", "--dirty", "--abbrev=40"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip() or None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor() or "cpu"


def measure(root: Path, sizes: Sizes, device: torch.device, data_dir: str | None) -> dict:
    from rich.console import Console

    from peradapt.federation.clients import LocalClients
    from peradapt.seeds import SERVER, derive_seed, sample_clients

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="peradapt-reference-round-") as workdir:
        session = peradapt_session(sizes, str(device), data_dir, Path(workdir))
    method, seed = session.method, session.config.seed
    said = io.StringIO()
    local_clients = LocalClients(session, Console(file=said, width=200))  # --concurrent-clients auto
    print(said.getvalue().strip() or "peradapt: clients one after another", file=sys.stderr)
    together = local_clients.concurrent[1] if local_clients.concurrent is not None else 1
    federated = list(range(sizes.clients))
    sampled = sample_clients(seed, 0, sizes.clients, sizes.clients_per_round)
    trained = method.clients_to_train(sampled, federated)
    sampled_images = [len(session.data.clients[c].train) for c in sampled]
    if any(count % sizes.batch_size == 1 for count in sampled_images):
        # Their DataLoader keeps the last, short batch, and a batch of one image fails in their training-mode
        # BatchNorms of the 1x1 feature maps ("Expected more than 1 value per channel when training").
        sys.exit(
            f"error: a sampled client has 1 image more than a multiple of the batch size {sizes.batch_size} "
            f"({sampled_images}), which the authors' code cannot train: give another --limit-samples"
        )

    reference = load_reference(root)
    optimizer, args = reference_optimizer(reference, session, sizes, sampled, device)
    # What their round trains (requires_grad after Our's set-up): adapters, bn1/bn2 and the classifier.
    reference_trainable = sum(p.numel() for p in optimizer.global_model.parameters() if p.requires_grad)

    played = {"reference": 0, "peradapt": 0}
    state = {"global": session.initial}
    last = {}  # what the last round of each side did, to check that both did the same work

    def reference_round() -> None:
        played["reference"] += 1  # from round 1: round 0 would be an evaluation round (0 % eval_every)
        printed = io.StringIO()
        with cudnn_benchmark(True), contextlib.redirect_stdout(printed):
            optimizer.run_one_round(played["reference"])
        lines = printed.getvalue().splitlines()  # a line per epoch: "personalized cli ..." and "cli ..."
        last["reference_personal_epochs"] = sum(line.startswith("personalized cli ") for line in lines)
        last["reference_local_epochs"] = sum(line.startswith("cli ") for line in lines)

    def peradapt_round() -> None:
        round_index = played["peradapt"]
        played["peradapt"] += 1
        payloads = {c: method.payload(c, state["global"]) for c in trained}
        updates = local_clients.train(round_index, trained, payloads, lambda client_id: None)
        by_client = {update.client_id: update for update in updates}
        last["peradapt_client_samples"] = sum(update.work.samples for update in updates)
        server_seed = derive_seed(seed, round_index, SERVER)
        state["global"], _ = method.server_update(
            state["global"], [by_client[c] for c in sampled], server_seed, round_index
        )

    set_up_s = time.perf_counter() - started
    warm_up = {"reference": sizes.reference_warm_up, "peradapt": sizes.warm_up}
    times = interleaved({"reference": reference_round, "peradapt": peradapt_round}, warm_up, sizes.repeats, device)
    ratios = [a / b for a, b in zip(times["reference"], times["peradapt"], strict=True)]
    steps = sum(2 * sizes.epochs * -(-n // sizes.batch_size) for n in sampled_images)
    return {
        "vs_reference_round": statistics.median(ratios),
        "reference_round_s": statistics.median(times["reference"]),
        "peradapt_round_s": statistics.median(times["peradapt"]),
        "reference_round_times_s": times["reference"],
        "peradapt_round_times_s": times["peradapt"],
        "distillation": "excluded on both sides (authors: --aggregation mean; peradapt: --method perada-nokd)",
        "device": str(device),
        "device_name": device_name(device),
        "reference": {"repository": REPOSITORY, "commit": reference_commit(root), "path": str(root)},
        "peradapt_commit": git_head(Path(__file__).resolve().parent),
        "sizes": {
            **asdict(sizes),
            "sampled_clients": sampled,
            "sampled_client_images": sampled_images,
            "round_images": 2 * sizes.epochs * sum(sampled_images),
            "round_sgd_steps": steps,
            "last_round": last,  # epochs the authors' code printed; samples peradapt's clients trained
            "image_size": 32,
            "data": "fmnist, 3 channels, 32 px, partition dir-balanced:0.1",
            "data_dir": data_dir or str(DEBIAN_FMNIST),
        },
        "reference_settings": {
            "script": "scripts/cifar10/perada-nokd.sh, epochs scaled",
            "net": args.net,
            "lmbda": args.lmbda,
            "lr": args.lr,
            "batch_size": args.batch_size,
            "num_epochs": args.num_epochs,
            "adapter_dropout": args.adapter_dropout,
            "dataloader_workers": sizes.workers,
            "trainable_parameters": reference_trainable,
            "precision": "float32",
            "cudnn_benchmark": device.type == "cuda",
        },
        "peradapt_settings": {
            "preset": "perada-cifar10",
            "method": "perada-nokd",
            "concurrent_clients": together,
            "concurrent_clients_said": said.getvalue().strip(),
            "lam": session.config.method.lam,
            "lr": session.config.method.lr,
            "frozen_bn": session.config.method.frozen_bn,
            "augment": "crop-flip",
            "trainable_parameters": session.model.num_trainable(),
            "precision": "bf16 autocast, channels-last" if device.type == "cuda" else "float32",
        },
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "set_up_s": set_up_s,
    }


def reference_commit(root: Path) -> str | None:
    recorded = root / "COMMIT"
    if recorded.is_file():
        return recorded.read_text().strip() or None
    return git_head(root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--reference", type=Path, default=DEFAULT_REFERENCE, help="the NVlabs/PerAda tree (default: %(default)s)"
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda where one is visible, else cpu")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--smoke", action="store_true", help="toy size, one repetition: checks that both sides run")
    parser.add_argument(
        "--data-dir",
        help=f"Fashion-MNIST's IDX files (default: Debian's {DEBIAN_FMNIST}, else {CARRIED_FMNIST} if it exists)",
    )
    parser.add_argument("--epochs", type=int, help="personal and local epochs each (default 1)")
    parser.add_argument("--repeats", type=int, help="timed rounds per side (default 5)")
    parser.add_argument("--warm-up", type=int, help="untimed peradapt rounds first (default 3; the authors': 1)")
    parser.add_argument("--limit-samples", type=int, help="images per split of Fashion-MNIST (default 11000)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default %(default)s)")
    args = parser.parse_args()
    root = args.reference.resolve()
    if not (root / "optim" / "our.py").is_file():
        sys.exit(
            f"error: --reference {args.reference}: no NVlabs/PerAda tree there (optim/our.py missing); export it "
            "there with git archive (see this file's docstring)"
        )
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda: no CUDA GPU is visible")
    sizes = SMOKE if args.smoke else Sizes()
    overrides = {"epochs": args.epochs, "repeats": args.repeats, "warm_up": args.warm_up}
    overrides["limit_samples"] = args.limit_samples
    sizes = Sizes(**{**asdict(sizes), **{k: v for k, v in overrides.items() if v is not None}})
    data_dir = args.data_dir
    if data_dir is None and not DEBIAN_FMNIST.is_dir() and CARRIED_FMNIST.is_dir():
        data_dir = str(CARRIED_FMNIST)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    results = measure(root, sizes, device, data_dir)
    results["total_s"] = time.perf_counter() - started
    results["smoke"] = args.smoke
    print(
        f"vs_reference_round {results['vs_reference_round']:.3f}: the authors' round "
        f"{results['reference_round_s']:.3f} s, peradapt's {results['peradapt_round_s']:.3f} s "
        f"({results['device_name']}, {results['sizes']['round_sgd_steps']} SGD steps of batch {sizes.batch_size} "
        f"a round, {results['peradapt_settings']['concurrent_clients']} clients at once in peradapt; "
        f"{results['total_s']:.0f} s in all)"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
