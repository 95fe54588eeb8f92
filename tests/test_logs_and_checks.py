"""Issue 25, items 7-9: progress in logs (plain lines without a terminal), the checks that need no images made before
any data is loaded, counts in the singular, and environment variables set empty taken as unset."""

from __future__ import annotations

import io
import itertools
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from rich.console import Console
from rich.progress import Progress

import peradapt.federation.session
import peradapt.progress
from peradapt.config import TrainConfig
from peradapt.federation.tracking import MLFLOW_DIR, MlflowTracker
from peradapt.home import peradapt_home
from peradapt.progress import PROGRESS_INTERVAL_S, ProgressLines, counted, progress_display

from .conftest import TINY_BACKBONE
from .test_cli import expect_refusal, run_cli, run_main, tiny_args

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- progress without a terminal (item 8)


class Clock:
    """A clock the test moves by hand: no sleeping, no real time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def log_display(clock: Clock) -> tuple[ProgressLines, io.StringIO]:
    log = io.StringIO()
    display = progress_display(Console(file=log, markup=False, width=300), clock=clock)
    assert isinstance(display, ProgressLines)  # a StringIO is no terminal: lines, not bars
    return display, log


def test_on_a_terminal_progress_is_rich_bars():
    assert isinstance(progress_display(Console(file=io.StringIO(), force_terminal=True)), Progress)


def test_fast_clients_get_a_line_every_30_s_and_one_when_the_round_ends():
    clock = Clock()
    display, log = log_display(clock)
    with display:
        clients = display.add_task("round 1: clients", total=20, samples=0)
        for client in range(1, 21):  # 4 s and 100 samples a client
            clock.now += 4
            display.update(clients, advance=1, samples=100 * client)
    assert log.getvalue().splitlines() == [
        "round 1: clients  8/20  25 samples/s  elapsed 0:00:32",  # the first client 30 s after the start
        "round 1: clients  16/20  25 samples/s  elapsed 0:01:04",
        "round 1: clients  20/20  25 samples/s  elapsed 0:01:20",  # the end of a task that had a line
    ]


def test_slow_clients_get_a_line_each_and_a_short_task_none():
    clock = Clock()
    display, log = log_display(clock)
    with display:
        clients = display.add_task("round 1: clients", total=3, samples=0)
        for client in range(1, 4):
            clock.now += 2 * PROGRESS_INTERVAL_S
            display.update(clients, advance=1, samples=12 * client)  # slower than one a second: not "0"
        display.remove_task(clients)
        server = display.add_task("round 1: server", total=5)
        for step in range(1, 6):  # 5 s in all: no line
            clock.now += 1
            display.update(server, completed=step)
    assert log.getvalue().splitlines() == [
        "round 1: clients  1/3  0.2 samples/s  elapsed 0:01:00",
        "round 1: clients  2/3  0.2 samples/s  elapsed 0:02:00",
        "round 1: clients  3/3  0.2 samples/s  elapsed 0:03:00",
    ]


def test_every_step_of_a_task_so_marked_is_a_line_and_text_is_never_markup():
    clock = Clock()
    display, log = log_display(clock)
    with display:
        rounds = display.add_task("rounds", total=2, completed=0, log_each_step=True)
        ready = display.add_task("corruptions ready", total=None)
        for round_number in (1, 2):
            clock.now += 1
            display.update(rounds, advance=1, description=f"round {round_number} [bold]w[/b]")
        clock.now += PROGRESS_INTERVAL_S
        display.update(ready, total=15, advance=1)
    assert log.getvalue().splitlines() == [
        "round 1 [bold]w[/b]  1/2  elapsed 0:00:01",
        "round 2 [bold]w[/b]  2/2  elapsed 0:00:02",
        "corruptions ready  1/15  elapsed 0:00:32",
    ]


def test_a_run_in_a_log_prints_its_clients_with_samples_per_second_and_its_rounds(
    tmp_path, fmnist_dir, capsys, monkeypatch, home
):
    ticks = itertools.count(step=PROGRESS_INTERVAL_S)  # every reading of the clock a step of 30 s later
    monkeypatch.setattr(peradapt.progress, "monotonic", lambda: float(next(ticks)))
    code, out, err = run_cli(tiny_args(fmnist_dir, tmp_path / "run", "--rounds", "1"), capsys, monkeypatch)
    assert code == 0, err
    clients = re.findall(r"^round 1: clients  (\d)/2  [\d,.]+ samples/s  elapsed \d+:\d\d:\d\d$", err, re.M)
    assert clients == ["1", "2"]  # a line as each client finishes: 30 s have passed each time
    assert re.search(r"^round 1  loss [\d.]+  1/1  elapsed \d+:\d\d:\d\d$", err, re.M), err
    assert re.search(r"^final evaluation and export  4/4  elapsed", err, re.M), err
    assert "4 clients, 1 round" in out and "1 rounds" not in out, out  # the results table's title


# ---------------------------------------------------------------- checks before any data is loaded (item 7)


@pytest.fixture
def no_loading(monkeypatch) -> list[str]:
    """The data sets a session went on to load while the fixture is on: none, for a refusal that needs no images.
    (The data layer's own checks, partition specs and --kd-data names among them, come before it scans or decodes a
    file: tests/test_data*.py.)"""
    loaded: list[str] = []

    def build_federation(dataset: str, *args, **kwargs):
        loaded.append(dataset)
        raise AssertionError(f"{dataset} was loaded before a check that needs no images")

    monkeypatch.setattr(peradapt.federation.session, "build_federation", build_federation)
    return loaded


@pytest.fixture
def image_folder(tmp_path) -> Path:
    """Two classes of 28 px grey PNGs."""
    rng = np.random.default_rng(0)
    for name in ("cat", "dog"):
        (tmp_path / "pets" / name).mkdir(parents=True)
        for index in range(6):
            Image.fromarray(rng.integers(0, 255, (28, 28), dtype=np.uint8)).save(
                tmp_path / "pets" / name / f"{index}.png"
            )
    return tmp_path / "pets"


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--holdout-clients", "3"], ["--clients-per-round 2", "the 1 client left", "--holdout-clients 3"]),
        (["--backbone", "resnet999"], ["resnet999"]),
        (["--weights", "nowhere.safetensors"], ["nowhere.safetensors", "does not exist"]),
        (["--method", "fedavg", "--lam", "auto"], ["--lam auto", "fedavg", "fedprox"]),
    ],
)
def test_mistakes_that_need_no_images_are_refused_before_the_data_is_loaded(
    extra, needles, tmp_path, fmnist_dir, capsys, monkeypatch, home, no_loading
):
    run = tmp_path / "run"
    expect_refusal(tiny_args(fmnist_dir, run, *extra), capsys, monkeypatch, *needles, untouched=run)
    assert no_loading == []


def imagefolder_args(folder: Path, run: Path) -> list[str]:
    return [
        "train",
        *("--data", f"imagefolder:{folder}", "--backbone", TINY_BACKBONE, "--clients", "2"),
        *("--clients-per-round", "2", "--rounds", "1", "--partition", "iid", "--device", "cpu", "--out", str(run)),
    ]


def test_no_weights_for_an_imagefolder_names_the_backbones_pretrain_stored(
    tmp_path, image_folder, capsys, monkeypatch, home, no_loading
):
    run = tmp_path / "run"
    stored = home / "backbones" / f"fmnist-{TINY_BACKBONE}.safetensors"  # the session's `pretrain` made it
    err = expect_refusal(
        imagefolder_args(image_folder, run),
        capsys,
        monkeypatch,
        f"no pretrained weights for {TINY_BACKBONE}",
        f"fmnist-{TINY_BACKBONE}.safetensors",
        f"--weights {stored}",
        untouched=run,
    )
    assert no_loading == [] and "decoding" not in err


def test_no_weights_without_a_stored_backbone_says_how_to_get_some(
    tmp_path, image_folder, capsys, monkeypatch, no_loading
):
    monkeypatch.setenv("PERADAPT_HOME", str(tmp_path / "empty-home"))
    run = tmp_path / "run"
    err = expect_refusal(
        imagefolder_args(image_folder, run), capsys, monkeypatch, "--weights FILE.safetensors", untouched=run
    )
    assert no_loading == [] and "already stored" not in err


@pytest.fixture(scope="module")
def one_round_run(tmp_path_factory, pretrained_home, fmnist_dir) -> Path:
    run = tmp_path_factory.mktemp("runs") / "one-round"
    run_main(tiny_args(fmnist_dir, run, "--rounds", "1"), pretrained_home)
    return run


def test_resuming_with_fewer_rounds_than_done_is_refused_before_the_data_is_loaded(
    one_round_run, fmnist_dir, capsys, monkeypatch, home, no_loading
):
    args = tiny_args(fmnist_dir, one_round_run, "--resume", "--rounds", "0")
    expect_refusal(args, capsys, monkeypatch, "has done 1 round,", "--rounds 1 or more", untouched=one_round_run)
    assert no_loading == []


# ---------------------------------------------------------------- small items (item 9)


def test_counts_are_singular_for_one():
    assert counted(1, "round") == "1 round"
    assert [counted(n, "client") for n in (0, 2, 1200)] == ["0 clients", "2 clients", "1,200 clients"]
    assert counted(1, "class", "classes") == "1 class" and counted(3, "class", "classes") == "3 classes"


def test_an_empty_mlflow_tracking_uri_means_the_runs_own_store(tmp_path, monkeypatch):
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.setenv(name, "")  # set, but empty, as `MLFLOW_TRACKING_URI=` in a job script leaves it
    tracker = MlflowTracker(tmp_path / "run")
    tracker.start(TrainConfig(), {}, None)
    tracker.close()
    assert tracker.state() == {"run_id": tracker.run_id}  # no tracking URI kept: the run's own store
    assert (tmp_path / "run" / MLFLOW_DIR).is_dir()


def test_an_empty_peradapt_home_means_the_default(monkeypatch):
    monkeypatch.setenv("PERADAPT_HOME", "")
    assert peradapt_home() == Path.home() / ".cache" / "peradapt"
