"""`--dry-run` of `peradapt train` and `peradapt compare`: what a run or a sweep would do and about how long it would
take on this machine, before anything is written.

Each run's session is built as the run builds it (`build_session`: every input checked, a --budget the run cannot
reach refused by `check_budget`) and its work counted as the engine's round loop (`federation.rounds.FederatedRun`)
and final evaluation (`FederatedRun.finish`) would do it:

- each round, the clients it samples (`seeds.sample_clients`), those the method trains (`Method.clients_to_train`)
  and the training samples of each (`Method.client_samples_bound`: exact for local SGD by epochs or steps, an upper
  figure where a method's work varies); under --budget client-samples:N the final personalization is set aside and
  the last round's clients do the share of their work that is left, as the engine does (`budget.budget_share`);
  every client answers and none straggles (--participation and --stragglers only lower the work);
- the personalization a method trains when it hands out a client's model (`Method.personalization_samples`:
  fine-tuning), at each evaluation and after the rounds: in the client samples (the final one, as --budget counts
  it) and in the time (both);
- the distillation steps of the rounds that distill (`Distiller.active`) and their validation checks
  (`validation_checks`);
- the images scored: every --eval-every rounds the evaluated clients' test splits with their personalized and the
  global adapter, and the global test set with the global adapter; at the end every federated client's, and the
  global test set with each evaluated client's personalized adapter.

The unit times are measured on the run's own model and data, as benchmarks/bench.py's estimate phase measures them
on a preset's model and random images: a step of local SGD at --batch-size on the largest client
(`LocalTrainer.sgd`), an image of inference (`LocalTrainer.score`, what evaluation and the distillation's checks
run), and for a distilling method a distillation step with the round's teachers (`Distiller.distill`, between two
`on_step` calls) and what a distilling round costs besides its steps and checks (teacher logits cached once a round
in eval mode). Nothing else is timed, and nothing of the run is written (`estimate_sweep` never opens a run
directory).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import torch
from rich.table import Table

from peradapt.commands.tuning import searched, trial_stages
from peradapt.config import TrainConfig, settings_for_method
from peradapt.distill.kd import validation_checks
from peradapt.federation.budget import budget_limit, budget_share, check_budget, personalization_reserve
from peradapt.federation.session import Session, build_session
from peradapt.options import TUNING_SEED
from peradapt.progress import counted
from peradapt.seeds import sample_clients

TIMED_STEPS = 3  # client and distillation steps timed after a warm-up one: enough for a median-free mean of a few
NOT_COUNTED = "not counted: new clients, OOD sets, checkpoints and exports; every client answering and none straggling"


@dataclass(frozen=True)
class UnitTimes:
    """Seconds of the run's units of work, measured on this machine (`measured`)."""

    client_step_s: float  # one step of local SGD at --batch-size
    image_s: float  # one image of inference
    kd_step_s: float = 0.0  # one distillation step with the round's teachers (0: the method does not distill)
    kd_round_s: float = 0.0  # a distilling round's cost besides its steps and checks


@dataclass(frozen=True)
class Work:
    """What one run does, counted before it runs (see the module's docstring)."""

    rounds: int
    client_samples: int | None  # None: the method does not say (`Method.client_samples_bound`)
    client_steps: int | None
    distilling_rounds: int
    distillation_steps: int
    scored_images: int  # evaluation and the distillation's validation checks

    def seconds(self, units: UnitTimes) -> float | None:
        if self.client_steps is None:
            return None
        return (
            self.client_steps * units.client_step_s
            + self.distillation_steps * units.kd_step_s
            + self.distilling_rounds * units.kd_round_s
            + self.scored_images * units.image_s
        )


@dataclass(frozen=True)
class Estimate:
    """The runs of one method in one phase of a sweep: `final` (one run per seed, or `train`'s one run) or `trials`
    (`compare --tune`, each trial played to its end: an upper figure, as pruned trials stop early)."""

    method: str
    phase: str
    runs: int
    rounds: int  # the most rounds of one run (--budget may stop a run before --rounds)
    client_samples: int | None  # of all its runs
    distillation_steps: int
    scored_images: int
    seconds: float | None
    units: UnitTimes


def counted_work(session: Session, final_evaluations: int = 1) -> Work:
    """The work of the run of `session` (see the module's docstring); `final_evaluations`: how many times it
    finishes (a trial finishes at each of its stages)."""
    config, method = session.config, session.method
    fed = config.federation
    federated = session.federated_clients
    federated_ids = [client.client_id for client in federated]
    distiller = method.context.distiller
    limit = budget_limit(config)
    bounds = {client.client_id: method.client_samples_bound(client) for client in federated}
    known = None not in bounds.values()
    budgeted = limit is not None and known and session.trainer.privacy is None  # as `budget.budget_share` cuts
    reserve = personalization_reserve(session)  # the final personalization, which --budget sets aside
    samples = steps = rounds = distilling = 0.0
    for round_index in range(fed.rounds):
        if budgeted and samples + reserve >= limit:  # type: ignore[operator]
            break  # as `FederatedRun.play_rounds` stops: after the round that reached the budget (or took the rest)
        rounds += 1
        sampled = sample_clients(config.seed, round_index, len(federated), fed.clients_per_round)
        trained = method.clients_to_train(sampled, federated_ids)
        # the last round of a budget: a share of the work, as the engine cuts it
        cut = budget_share(session, limit - reserve - samples, trained, {}) if budgeted else None  # type: ignore[operator]
        share = 1.0 if cut is None else cut
        for client_id in trained:
            samples += share * (bounds[client_id] or 0)
            steps += share * _steps(bounds[client_id] or 0, len(session.data.clients[client_id].train), session)
        distilling += bool(distiller and distiller.active(round_index))
        if cut is not None:
            break
    evaluations = int(rounds) // fed.eval_every if fed.eval_every else 0
    evaluated = session.client_sample
    # fine-tuning at evaluation (`Method.personalization_samples`): each evaluation's, and the final one's
    tuned = {client.client_id: method.personalization_samples(client) for client in federated}
    steps += evaluations * sum(_steps(tuned[c.client_id], len(c.train), session) for c in evaluated)
    steps += final_evaluations * sum(_steps(tuned[c.client_id], len(c.train), session) for c in federated)
    test = len(session.data.global_test)
    evaluation = 2 * sum(len(client.test) for client in evaluated) + test  # personalized and global; global
    final = 2 * sum(len(client.test) for client in federated) + test + len(evaluated) * test
    checks = validation_checks(config.distill) * len(distiller.val_data) if distiller else 0
    return Work(
        rounds=int(rounds),
        client_samples=round(samples) + reserve if known else None,
        client_steps=round(steps) if known else None,
        distilling_rounds=int(distilling),
        distillation_steps=int(distilling) * config.distill.kd_steps,
        scored_images=evaluations * evaluation + final_evaluations * final + int(distilling) * checks,
    )


def _steps(samples: int, size: int, session: Session) -> float:
    """The minibatch steps of `samples` training samples in passes over a client's `size` images, each pass of
    ceil(size / B) steps (a last partial batch is a step too)."""
    return samples * -(-size // session.trainer.batch_size) / size if size else 0.0


def measured(session: Session) -> UnitTimes:
    """The unit times of the run of `session`, measured here on its model and data (see the module's docstring).
    Each is timed after a warm-up call (allocations, kernel selection)."""
    trainer, config, state = session.trainer, session.config, session.initial
    largest = max(session.federated_clients, key=lambda client: len(client.train))

    def sgd(steps: int) -> None:
        trainer.sgd(state, largest.train, epochs=1, lr=config.method.lr, seed=0, steps=steps)

    sgd(1)
    client_step_s = _seconds(session, lambda: sgd(TIMED_STEPS)) / TIMED_STEPS
    global_test = session.data.global_test
    scored = global_test.subset(range(min(len(global_test), 4 * trainer.batch_size)))
    trainer.score(state, scored)
    image_s = _seconds(session, lambda: trainer.score(state, scored)) / len(scored)
    distiller = session.method.context.distiller
    if distiller is None:
        return UnitTimes(client_step_s, image_s)
    # Steps 2.. between on_step calls hold no check when the checks fall after the last step only.
    short = replace(distiller.config, kd_steps=TIMED_STEPS + 1, kd_eval_every=TIMED_STEPS + 1, kd_patience=0)
    timed = replace(distiller, config=short)
    teachers = [state] * config.federation.clients_per_round
    marks: list[float] = []

    def on_step(step: int) -> None:
        _synchronize(session)
        marks.append(time.perf_counter())

    _synchronize(session)
    started = time.perf_counter()
    timed.distill(state, teachers, seed=0, on_step=on_step)
    kd_step_s = (marks[-1] - marks[0]) / TIMED_STEPS
    check_s = _seconds(session, lambda: trainer.score(state, distiller.val_data))
    # Before step 1's on_step: the starting check, the round's cached teacher logits if any, and step 1
    kd_round_s = max(0.0, marks[0] - started - check_s - kd_step_s)
    return UnitTimes(client_step_s, image_s, kd_step_s, kd_round_s)


def _seconds(session: Session, work: Callable[[], object]) -> float:
    _synchronize(session)
    started = time.perf_counter()
    work()
    _synchronize(session)
    return time.perf_counter() - started


def _synchronize(session: Session) -> None:
    if session.device.type == "cuda":
        torch.cuda.synchronize(session.device)


def estimate_sweep(settings: dict, methods: Sequence[str], seeds: Sequence[int], tune_trials: int = 0) -> dict:
    """What `compare` with these arguments would run (its flat `settings` as it passes them to its runs, the
    methods checked and with their anchors, the held-out clients set) and about how long it would take here: per
    method its `tune_trials` trials on the tuning seed (none where nothing is left to tune, as `tune` does) and its
    runs on `seeds`; `peradapt train`'s one run is `estimate_sweep(flat, [method], [seed])`. Finished runs and
    trials in --out are counted as if they were not (compare would reuse them). Returns `estimate_dict`'s shape."""
    rows: list[Estimate] = []
    device, gpu = "", False
    for method in methods:
        flat = {**settings_for_method(settings, method), "method": method}
        units: UnitTimes | None = None
        phases = [("final", [{**flat, "seed": seed} for seed in seeds], 1)]
        if tune_trials and searched(method, flat):
            trial = {**flat, "seed": TUNING_SEED, "eval_split": "validation"}  # as `tune` plays each trial
            stages = len(trial_stages(TrainConfig.from_flat(trial).federation.rounds))
            phases.insert(0, ("trials", [trial] * tune_trials, stages))
        for phase, configs, finishes in phases:
            if not configs:  # compare --tune-only: no final run
                continue
            works: list[Work] = []
            for values in configs[:1] if phase == "trials" else configs:  # trials differ in values, not in work
                session = build_session(TrainConfig.from_flat(values))
                check_budget(session)
                units = units or measured(session)
                device, gpu = _device_name(session), session.device.type == "cuda"
                works.append(counted_work(session, finishes))
            works *= len(configs) // len(works)
            assert units is not None
            seconds = [work.seconds(units) for work in works]
            samples = [work.client_samples for work in works]
            rows.append(
                Estimate(
                    method=method,
                    phase=phase,
                    runs=len(works),
                    rounds=max(work.rounds for work in works),
                    client_samples=None if None in samples else sum(s or 0 for s in samples),
                    distillation_steps=sum(work.distillation_steps for work in works),
                    scored_images=sum(work.scored_images for work in works),
                    seconds=None if None in seconds else sum(s or 0.0 for s in seconds),
                    units=units,
                )
            )
    return estimate_dict(rows, device, gpu)


def _device_name(session: Session) -> str:
    if session.device.type == "cuda":
        return torch.cuda.get_device_name(session.device)
    return f"CPU, {counted(torch.get_num_threads(), 'thread')}"


def estimate_dict(rows: list[Estimate], device: str, gpu: bool) -> dict:
    """The estimate as the API returns it: its rows, the totals, and the unit its hours are in (GPU-hours on a GPU,
    hours of this CPU otherwise)."""
    known = [row.seconds for row in rows if row.seconds is not None]
    seconds = sum(known) if len(known) == len(rows) else None
    return {
        "device": device,
        "gpu": gpu,
        "hours_unit": "GPU-hours" if gpu else "hours on this CPU",
        "rows": [asdict(row) for row in rows],
        "runs": sum(row.runs for row in rows),
        "seconds": seconds,
        "hours": None if seconds is None else seconds / 3600,
        "upper_figure": any(row.phase == "trials" for row in rows),
    }


def estimate_table(estimate: dict) -> Table:
    """The estimate as one table: a row per method and phase, then the total."""
    table = Table(title=f"dry run: nothing written; time measured on {estimate['device']}", title_justify="left")
    for column in ("method", "runs", "rounds/run", "client samples", "distill steps", "images scored", "time"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for row in estimate["rows"]:
        label = row["method"] + (f" trials, seed {TUNING_SEED}" if row["phase"] == "trials" else "")
        table.add_row(
            label,
            f"{row['runs']:,}",
            f"{row['rounds']:,}",
            _count(row["client_samples"]),
            f"{row['distillation_steps']:,}",
            f"{row['scored_images']:,}",
            _duration(row["seconds"]),
        )
    table.add_section()
    samples = [row["client_samples"] for row in estimate["rows"]]
    total_samples = None if None in samples else sum(samples)
    table.add_row("total", f"{estimate['runs']:,}", "", _count(total_samples), "", "", _duration(estimate["seconds"]))
    return table


def estimate_lines(estimate: dict) -> list[str]:
    """What the table's total comes to, and what it leaves out."""
    hours, most = estimate["hours"], " at most" if estimate["upper_figure"] else ""
    lines = [
        f"estimated {_duration(estimate['seconds'])}{most} in all: {hours:,.2f} {estimate['hours_unit']}"
        if hours is not None
        else "time unknown: a method does not say how many samples its clients train (client_samples_bound)"
    ]
    if estimate["upper_figure"]:
        lines.append("trials counted as played to their last round: pruned trials stop earlier")
    if estimate["gpu"]:
        lines.append("clients timed one after another: --concurrent-clients trains them together, faster")
    lines.append(NOT_COUNTED)
    return lines


def _count(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
