"""`peradapt compare`: several methods tuned on the same budget, repeated over seeds, costed and audited.

1. **Tuning** (`--tune N`): each method gets N trials over its own declared search space (`commands.tuning`),
   every trial scored on validation splits carved from the clients' training images (`--eval-split validation`):
   no test image reaches a model before the final runs. A value given on the command line is not searched.
2. **Final runs**: each method with its chosen settings once per seed, under `out/<method>-seed<seed>/`; a seed
   fixes the partition, the client sampling and the initial adapters, so every method sees the same clients. A
   finished run is reused and an interrupted one resumed, so re-running a comparison only does what is missing.
3. **After each run**, from its exported models: its held-out clients personalized (`peradapt personalize`;
   compare holds out 10% of the clients unless --holdout-clients is given) and the OOD set where asked (`peradapt
   eval --ood`), each kept in the run directory like the commands' own results.
4. **Rows**: per metric the mean over seeds with its 95% interval (`evaluation.statistics`), the paired difference
   to the reference method over the same seeds with a paired t-test, ranks that tie where the test cannot separate
   methods, and the runs' costs (report.json `cost`); how fast each method learns (`evaluation.curves`): its
   curve (local-test at every evaluated round, over seeds), the first round it reaches a target and the area
   under its curve.
5. **Files**: compare.json (rows, ranks, every trial, the audit), compare.md, ranking.png, accuracy_vs_cost.png
   and the curves against rounds, client samples and bytes (curves_*.png).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import cast

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from peradapt.commands.estimate import estimate_sweep
from peradapt.commands.finished_run import evaluate_ood_run, ood_report_name
from peradapt.commands.newclients import NEW_CLIENTS_DIR, personalize_new_client
from peradapt.commands.reports import cost_panels, read_metrics, read_new_clients, read_ood, round_curve
from peradapt.commands.training import train
from peradapt.commands.tuning import TIE_RULE, tune
from peradapt.config import (
    COMPARE_SETS,
    OUTCOME_FREE,
    TrainConfig,
    method_path_label,
    setting_owners,
    settings_for_method,
)
from peradapt.errors import ConfigError, RunError
from peradapt.evaluation import METRIC_LABELS
from peradapt.evaluation.curves import Evaluation, area_per_round, first_reaching, mean_curve
from peradapt.evaluation.plots import RankedScore, plot_accuracy_vs_cost, plot_curves, plot_ranking
from peradapt.evaluation.statistics import (
    ALPHA,
    TEST_LABELS,
    PairedTest,
    PairedTestName,
    holm_adjusted,
    over_seeds,
    paired_difference,
    tied_ranks,
)
from peradapt.federation.budget import check_budget
from peradapt.federation.lifecycle import resume_config
from peradapt.federation.session import build_session
from peradapt.methods import method_class
from peradapt.options import TUNING_SEED, CompareOptions
from peradapt.progress import counted, text_console
from peradapt.rundir.checkpoint import write_json_atomic, write_text_atomic
from peradapt.rundir.layout import RunPaths, read_report, read_run_config
from peradapt.rundir.records import Cost, Report

ANCHORS = ("standalone", "fedavg-ft")  # Local training alone and FedAvg + fine-tuning: what any pFL method must beat
DEFAULT_REFERENCE = "perada"
HOLDOUT_SHARE = 0.1  # of the clients, held out for the new-client metric unless --holdout-clients is given
SELECTION = "the models after the last round (no round is chosen on test data)"


@dataclass(frozen=True)
class Metric:
    """A number of the table: its key in compare.json, its column, and which model was scored on what (the audit)."""

    key: str
    label: str
    scored: str


PRIMARY = Metric(
    "local_test",
    "local-test",
    "each trained client's personalized model on its own local-test split; mean over clients",
)
METRICS = (
    PRIMARY,
    Metric("local_test_weighted", "weighted", "as local-test, the mean weighted by each client's test images"),
    Metric("local_test_worst_10pct", "worst 10%", "as local-test, the mean of the worst 10% of clients"),
    Metric("local_test_client_std", "std over clients", "as local-test, the standard deviation over clients"),
    Metric("global_test", "global-test of w", "the global model on the global test set (all clients' test splits)"),
    Metric(
        "new_client",
        "new clients",
        "each held-out client's model personalized from the final global model (`peradapt personalize`) on its own "
        "local-test split; mean over the held-out clients",
    ),
    Metric("new_client_gap", "gap", "local-test minus new clients: what a client loses by joining after training"),
    Metric("ood", "OOD", "each trained client's personalized model on the OOD set (`peradapt eval --ood`); mean"),
    Metric(
        "local_test_auc",
        "area under curve",
        "as local-test, at every evaluated round (--eval-every; the last round's the final evaluation), the area "
        "under it against rounds (trapezoid rule) over the rounds from the first evaluation to the last: the mean "
        "score over training",
    ),
)
ROUND_KEY = "personalized_local_test"  # PRIMARY as metrics.jsonl records it at an evaluated round
TARGET_SHARE = 0.9  # the default target of "rounds to": this share of the best method's final mean local-test
# (x field of a curve point, axis name, file): the curves against rounds and the cumulative costs
CURVE_AXES = (
    ("round", "rounds", "curves_rounds.png"),
    ("client_samples", "client training samples, cumulative", "curves_client_samples.png"),
    ("bytes", "bytes sent down and up, cumulative", "curves_bytes.png"),
)
# report.json `cost` entries the table shows, each a total per run (mean over seeds); the clients' work includes the
# personalization the method trains when it hands out their models (what --budget counts)
COSTS = (
    ("bytes_total", "MB sent", 1e-6),
    ("client_samples", "client samples", 1.0),
    ("client_flops", "client TFLOPs", 1e-12),
    ("server_flops", "server TFLOPs", 1e-12),
    ("new_client_samples", "new-client samples", 1.0),
    ("client_seconds", "client s", 1.0),
    ("server_seconds", "server s", 1.0),
)


def compare(options: CompareOptions, settings: dict, console: Console | None = None) -> dict:
    """Tune (`options.tune` > 0), train (or reuse) every method x seed run, and return what compare.json holds.

    `settings`: the flat `train` settings of every run. Of `options`: `anchors` adds standalone and fedavg-ft where
    missing; `reference` (default perada if compared, else the first method) is the method every other is tested
    against; `ood` names an OOD set to evaluate every run on; `tune_only` stops after the trials (a worker sharing
    the study through `storage`). `test`: the paired test (`evaluation.statistics.paired_difference`: t or
    wilcoxon), whose p are Holm-adjusted over the comparisons shown together (each method against the reference;
    all pairs for the ranks). `dry_run`: instead, what the sweep would run and about how long it would take here,
    with nothing written (`commands.estimate`). `target_accuracy`: the local-test (percent) that "rounds to" counts
    to (default: `TARGET_SHARE` of the best method's final mean)."""
    console = console or text_console(stderr=True)
    out, tune_trials, ood, ood_limit = options.out, options.tune, options.ood, options.ood_limit
    test = cast(PairedTestName, options.test)
    seeds = range(options.seeds)
    methods = _checked_methods(settings, options.method_names, options.anchors)
    reference = _reference(options.reference, methods)
    settings = _with_holdout(settings, methods[0], console)
    if options.dry_run:
        return estimate_sweep(settings, methods, [] if options.tune_only else seeds, tune_trials)
    if settings.get("budget") is not None:
        _check_budget(settings, methods, seeds[0])
    tuning = (
        {
            # on a partition of their own: TUNING_SEED is none of the final seeds
            method: tune(
                method,
                {**settings, "seed": TUNING_SEED},
                trials=tune_trials,
                out=out,
                storage=options.storage,
                console=console,
            )
            for method in methods
        }
        if tune_trials
        else {}
    )
    if options.tune_only:
        return {"methods": methods, "tuning": tuning}
    chosen = {method: tuning[method]["best_params"] if tuning else {} for method in methods}
    runs = {
        method: [_final_run(settings, chosen[method], method, seed, out, console) for seed in seeds]
        for method in methods
    }
    facts = {method: [_facts(run, ood, ood_limit, console) for run in runs[method]] for method in methods}
    others = [method for method in methods if method != reference]
    against = [
        paired_difference(_column(facts[m], PRIMARY.key), _column(facts[reference], PRIMARY.key), test=test)
        for m in others
    ]
    versus = dict(zip(others, holm_adjusted(against), strict=True))
    versus[reference] = paired_difference(
        _column(facts[reference], PRIMARY.key), _column(facts[reference], PRIMARY.key), test=test
    )
    rows = [_row(method, runs[method], facts[method], versus[method], chosen[method]) for method in methods]
    ranks = tied_ranks({method: _column(facts[method], PRIMARY.key) for method in methods}, test=test)
    for rank in ranks:
        next(row for row in rows if row["method"] == rank.method)["rank"] = rank.label
    rows.sort(key=lambda row: [rank.method for rank in ranks].index(row["method"]))
    curves = {row["method"]: mean_curve([fact["curve"] for fact in facts[row["method"]]]) for row in rows}
    target = _target(options.target_accuracy, rows)
    for row in rows:
        row["curve"] = [point.as_dict() for point in curves[row["method"]]]
        reached = first_reaching(curves[row["method"]], target["score"])
        row["to_target"] = None if reached is None else reached.as_dict()
    result = {
        "settings": settings,
        "methods": methods,
        "seeds": list(seeds),
        "reference": reference,
        "test": TEST_LABELS[test],
        "correction": "Holm, over each method against the reference, and over all pairs for the ranks",
        "tune": tune_trials,
        "tuning_seed": TUNING_SEED if tune_trials else None,
        "tuning_tie_rule": TIE_RULE if tune_trials else None,
        "target": target,
        "rows": rows,
        "ranks": [rank.as_dict() for rank in ranks],
        "tuning": tuning,
        "audit": _audit(runs, facts, ood),
    }
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "compare.json", result)
    write_text_atomic(out / "compare.md", markdown_table(result))
    plot_ranking([_ranked(row) for row in rows], PRIMARY.label, reference, out / "ranking.png")
    y_name = f"personalized {PRIMARY.label} {METRIC_LABELS[rows[0]['metric']]} %"
    costed = [{"report": fact["report"]} for method in methods for fact in facts[method]]
    plot_accuracy_vs_cost(cost_panels(costed), y_name, out / "accuracy_vs_cost.png")
    for x, x_name, name in CURVE_AXES:
        plot_curves(curves, x, x_name, y_name, target["score"], out / name)
    return result


def _checked_methods(settings: dict, methods: Sequence[str], anchors: bool) -> list[str]:
    """The methods to compare (the anchors added), every name known and every setting taken by one of them, before
    anything trains."""
    fixed = sorted(COMPARE_SETS & settings.keys())
    if fixed:
        raise ConfigError(
            f"compare sets {', '.join(fixed)} itself: leave them out (use --methods, --seeds, --out; trials score "
            "on validation splits, the final runs on test splits)"
        )
    if not methods:
        raise ConfigError("compare needs at least one method in --methods")
    listed = list(dict.fromkeys([*methods, *(ANCHORS if anchors else ())]))
    for method in listed:
        method_class(method)  # unknown names stop the comparison before anything trains
    for key in settings:
        owners = setting_owners(key.replace("-", "_"))
        if owners and not set(owners) & set(listed):
            raise ConfigError(
                f"--{key.replace('_', '-')} is a setting of {', '.join(owners)}: none of --methods "
                f"{', '.join(listed)} takes it"
            )
    return listed


def _reference(reference: str | None, methods: list[str]) -> str:
    if reference is None:
        return DEFAULT_REFERENCE if DEFAULT_REFERENCE in methods else methods[0]
    if reference not in methods:
        raise ConfigError(f"--reference {reference} is not among the compared methods ({', '.join(methods)})")
    return reference


def _with_holdout(settings: dict, method: str, console: Console) -> dict:
    """`settings` with 10% of the clients held out for the new-client metric, where the user chose nothing and the
    federation has room for it (its --clients-per-round still fits)."""
    if "holdout_clients" in settings:
        return settings
    federation = TrainConfig.from_flat({**settings_for_method(settings, method), "method": method}).federation
    held_out = math.ceil(HOLDOUT_SHARE * federation.clients) if federation.clients > 1 else 0
    if held_out == 0 or federation.clients - held_out < federation.clients_per_round:
        console.print(
            "note: no client is held out (--clients-per-round leaves no room), so there is no new-client accuracy: "
            "pass --holdout-clients K with fewer clients per round for it"
        )
        return settings
    return {**settings, "holdout_clients": held_out}


def _check_budget(settings: dict, methods: list[str], seed: int) -> None:
    """--budget: refused before anything trains when one of the methods cannot reach it within --rounds (a run
    checks its own too, but by then the methods before it would have trained)."""
    for method in methods:
        config = TrainConfig.from_flat({**settings_for_method(settings, method), "method": method, "seed": seed})
        check_budget(build_session(config))


def _final_run(settings: dict, chosen: dict, method: str, seed: int, out: Path, console: Console) -> Path:
    """The finished run of `method` with its chosen settings at `seed`: trained, resumed or reused."""
    flat = settings_for_method({**settings, **chosen}, method)
    directory = out / f"{method_path_label(method)}-seed{seed}"
    config = TrainConfig.from_flat({**flat, "method": method, "seed": seed, "out": str(directory)})
    paths = RunPaths(directory)
    if not paths.config.exists():
        console.print(Text.assemble((method, "bold"), f", seed {seed}"))
        train(config, console=console)
        return directory
    saved = resume_config(paths.root, {})
    if _comparable(saved) != _comparable(config):
        raise RunError(f"{paths.root} holds a run with other settings: remove it or pass another --out")
    if read_report(paths.root) is None:  # checked: None until the run has finished
        train(saved, resume=True, console=console)
    return directory


def _comparable(config: TrainConfig) -> dict:
    """The settings a finished run must share to be reused: all but those no result depends on."""
    return {key: value for key, value in config.to_flat().items() if key not in OUTCOME_FREE}


def _facts(run: Path, ood: str | None, ood_limit: int | None, console: Console) -> dict:
    """The numbers of one finished run (percent; costs as report.json gives them), evaluating what it lacks: its
    held-out clients personalized, its OOD set. Results already in the run directory are read, not redone."""
    report = read_report(run)
    for client in report.held_out_clients or []:
        if not (run / NEW_CLIENTS_DIR / str(client) / "result.json").is_file():
            personalize_new_client(run, str(client))
    if ood is not None and not (run / ood_report_name(ood)).is_file():
        evaluate_ood_run(run, ood, limit=ood_limit, console=console)
    local = report.personalized.local_test
    facts = {
        "local_test": 100 * local.mean,
        "local_test_client_std": 100 * local.std,
        "global_test": 100 * report.summary["global_global_test"],
        "local_test_weighted": 100 * local.weighted_mean,
        "local_test_worst_10pct": 100 * local.worst_10pct,
    }
    new_clients = read_new_clients(run)
    if new_clients is not None:
        facts["new_client"] = new_clients["after"]
        facts["new_client_gap"] = facts["local_test"] - facts["new_client"]
    if ood is not None:
        facts["ood"] = read_ood(run)[ood]["personalized"]
    curve = _evaluations(run, report)
    facts["local_test_auc"] = area_per_round(curve)
    return {**facts, "cost": _spent(report.cost, new_clients), "report": report, "curve": curve}


def _evaluations(run: Path, report: Report) -> list[Evaluation]:
    """The run's local-test (percent) at each evaluated round, the last round's from report.json, with the client
    samples and bytes spent up to it (the round records' `cost`; at the end, report.json's: all rounds')."""
    history = read_metrics(RunPaths(run).metrics)
    spent = {report.rounds: (report.cost.client_samples, report.cost.bytes_down + report.cost.bytes_up)}
    samples = sent = 0
    for record in history:
        samples += record.cost.client_samples
        sent += record.cost.bytes_down + record.cost.bytes_up
        spent[record.round] = (samples, sent)
    return [Evaluation(played, score, *spent[played]) for played, score in round_curve(history, report, ROUND_KEY)]


def _target(given: float | None, rows: list[dict]) -> dict:
    """The local-test (percent) that "rounds to" counts to, and the rule that set it: --target-accuracy, else
    `TARGET_SHARE` of the best method's final mean, which the best method reaches by its end at the latest."""
    if given is not None:
        return {"score": given, "rule": "given (--target-accuracy)"}
    best = max(row[PRIMARY.key]["mean"] for row in rows)
    return {"score": TARGET_SHARE * best, "rule": f"{TARGET_SHARE:.0%} of the best method's final mean {PRIMARY.label}"}


def _spent(cost: Cost, new_clients: dict | None) -> dict:
    """A run's costs as the table shows them, with its new clients' personalization (`new_clients`, as
    `read_new_clients` gives it)."""
    timing = cost.timing
    return {
        "bytes_up": cost.bytes_up,
        "bytes_down": cost.bytes_down,
        "bytes_total": cost.bytes_up + cost.bytes_down,
        # the rounds' and the final personalization's
        "client_samples": cost.client_samples + cost.personalization_samples,
        "client_flops": cost.client_flops + cost.personalization_flops,
        "server_flops": cost.server_flops,
        **({"new_client_samples": new_clients["samples"]} if new_clients and "samples" in new_clients else {}),
        "client_seconds": timing.client_seconds,
        "server_seconds": timing.aggregation_seconds + timing.distillation_seconds,
        "peak_rss_bytes": timing.peak_rss_bytes,
        **({"peak_cuda_bytes": timing.peak_cuda_bytes} if timing.peak_cuda_bytes is not None else {}),
    }


def _column(facts: list[dict], key: str) -> list[float]:
    """One number per seed (NaN where a run has none: the statistics leave it out)."""
    return [float(fact.get(key, math.nan)) for fact in facts]


def _row(method: str, runs: list[Path], facts: list[dict], versus: PairedTest, chosen: dict) -> dict:
    _, resolved = read_run_config(runs[0])
    row = {
        "method": method,
        "scope": resolved.scope,
        "metric": facts[0]["report"].metric,
        **facts[0]["report"].cost.parameters.to_json(),  # per client, as measured in the run
        "tuned": chosen,
        "runs": [str(run) for run in runs],
    }
    for metric in METRICS:
        values = _column(facts, metric.key)
        if not all(math.isnan(value) for value in values):
            row[metric.key] = {"seeds": values, **over_seeds(values).as_dict()}
    row["vs_reference"] = versus.as_dict()
    row["cost"] = {  # per run, mean over seeds
        key: float(np.mean([fact["cost"][key] for fact in facts]))
        for key in facts[0]["cost"]
        if all(key in fact["cost"] for fact in facts)
    }
    budgets = [fact["report"].cost.budget for fact in facts]
    if all(budgets):  # --budget: whether every seed's run reached it, or --rounds stopped it first
        row["budget_reached"] = all(budget.reached for budget in budgets)
    return row


def _ranked(row: dict) -> RankedScore:
    entry = row[PRIMARY.key]
    low, high = entry["low"], entry["high"]  # within [0, 100], as the table shows them
    low = None if low is None else max(low, 0.0)
    high = None if high is None else min(high, 100.0)
    return RankedScore(row["method"], row["rank"], entry["mean"], low, high)


def _audit(runs: dict[str, list[Path]], facts: dict[str, list[dict]], ood: str | None) -> dict:
    """What a reader needs to check the table and run it again: each number's model and data, the split each seed
    scored (the SHA-256 of partition.json, the same for every method), and the versions that ran."""
    partitions: dict[int, set[str]] = {}
    versions: dict[str, set[str]] = {}
    for method_facts in facts.values():
        for fact in method_facts:
            report = fact["report"]
            partitions.setdefault(report.seed, set()).add(report.partition_sha256)
    scenarios: set[tuple[float, float]] = set()
    for method_runs in runs.values():
        for run in method_runs:
            config, resolved = read_run_config(run)
            for package, version in resolved.versions.items():
                versions.setdefault(package, set()).add(version)
            scenarios.add((config.federation.participation, config.federation.stragglers))
    for seed, hashes in partitions.items():
        if len(hashes) > 1:  # the methods' runs of a seed did not see the same clients: the pairing would be void
            raise RunError(
                f"the runs of seed {seed} were trained on different partitions: remove them and compare again"
            )
    return {
        "scored": {metric.key: metric.scored for metric in METRICS if metric.key != "ood" or ood},
        "selection": SELECTION,
        "partition_sha256": {str(seed): hashes.pop() for seed, hashes in sorted(partitions.items())},
        "versions": {package: sorted(found) for package, found in sorted(versions.items())},
        # the system heterogeneity every run trained under (train settings: the same for every method)
        "scenario": [{"participation": p, "stragglers": f} for p, f in sorted(scenarios)],
        "runs": {method: [str(run) for run in method_runs] for method, method_runs in runs.items()},
    }


# ---------------------------------------------------------------- the table


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _score(entry: dict | None, interval: bool = False) -> str:
    """mean ± std over seeds, and with `interval` the 95% interval of the mean; the mean alone for one seed."""
    if entry is None:
        return "-"
    text = _number(entry["mean"])
    if entry["std"] is not None:
        text += f" ± {_number(entry['std'])}"
        if interval:  # a score is a percentage: the t interval of few seeds can reach past either end
            text += f" [{_number(max(entry['low'], 0.0))}, {_number(min(entry['high'], 100.0))}]"
    return text


def _difference(row: dict, reference: str) -> str:
    """The paired difference to the reference: mean, interval, p, and "n.s." where the test does not separate them."""
    if row["method"] == reference:
        return "reference"
    test = row["vs_reference"]
    if test["mean_difference"] is None:
        return "-"
    text = f"{test['mean_difference']:+.2f}"
    if test["p_value"] is None:
        return f"{text} (one seed: no test)"
    text += f" [{test['low']:+.2f}, {test['high']:+.2f}] p={test['p_value']:.3g}"
    if test["p_holm"] is not None:
        text += f", Holm {test['p_holm']:.3g}"
    return text if test["significant"] else f"{text} n.s."


def _cost(row: dict, key: str, scale: float) -> str:
    value = row["cost"].get(key)
    if value is None:
        return "-"
    scaled = value * scale
    return f"{scaled:,.0f}" if scaled >= 100 else f"{scaled:.3g}"


# The columns a terminal shows besides the headline and its test (compare.md has them all)
TERMINAL_COLUMNS = (
    "rank",
    "method",
    "worst 10%",
    "global-test of w",
    "new clients",
    "area under curve",
    "MB sent",
    "client TFLOPs",
)
COUNTS = (("personalized", "# personal"), ("trained", "# trained"), ("communicated", "# sent"))  # PerAda's Table 1


def _parameters(row: dict, key: str) -> str:
    if key not in row:
        return "-"
    return f"{row[key] / 1e6:.2f}M" if row[key] >= 100_000 else f"{row[key] / 1e3:.1f}k"


def _score_of(row: dict, key: str) -> str:
    return _score(row.get(key))


def _rounds_to(row: dict) -> str:
    reached = row["to_target"]
    return "not reached" if reached is None else f"{reached['round']:g}"


def _columns(result: dict) -> list[tuple[str, Callable[[dict], str], bool]]:
    """(header, cell of a row, shown on a terminal) of the columns the comparison has: a metric no run measured is
    left out."""
    rows, reference = result["rows"], result["reference"]
    columns: list[tuple[str, Callable[[dict], str], bool]] = [
        ("rank", lambda row: row["rank"], True),
        ("method", lambda row: row["method"], True),
        ("scope", lambda row: row["scope"], False),
    ]
    for key, label in COUNTS:  # parameters per client, as the paper's Table 1 counts them
        columns.append((label, partial(_parameters, key=key), False))
    columns += [
        (f"{PRIMARY.label} (95% interval)", lambda row: _score(row.get(PRIMARY.key), interval=True), True),
        (f"Δ vs {reference}", lambda row: _difference(row, reference), True),
    ]
    for metric in METRICS[1:]:
        if any(metric.key in row for row in rows):
            columns.append((metric.label, partial(_score_of, key=metric.key), metric.label in TERMINAL_COLUMNS))
    columns.append((f"rounds to {result['target']['score']:.2f}%", _rounds_to, True))  # its header names the target
    for key, label, scale in COSTS:
        if any(key in row["cost"] for row in rows):
            columns.append((label, partial(_cost, key=key, scale=scale), label in TERMINAL_COLUMNS))
    return columns


def _title(result: dict) -> str:
    rows = result["rows"]
    metric = METRIC_LABELS[rows[0]["metric"]] if rows else METRIC_LABELS["accuracy"]  # one dataset: one metric
    tuned = f"each tuned with {counted(result['tune'], 'trial')} on validation splits" if result["tune"] else "untuned"
    test = result.get("test", TEST_LABELS["t"])
    return (
        f"Personalized models, {metric} % (mean ± std over {counted(len(result['seeds']), 'seed')}; {tuned}; "
        f"intervals within [0, 100]); ranks tie where a {test} (Holm-adjusted p < {ALPHA}) does not separate methods"
    )


def rich_table(result: dict) -> Table:
    """The table with the columns a terminal shows (compare.md has every column)."""
    columns = [(header, cell) for header, cell, on_terminal in _columns(result) if on_terminal]
    table = Table(title=_title(result), caption="every column: compare.md")
    for index, (header, _) in enumerate(columns):
        table.add_column(header, justify="left" if index < 2 else "right")
    for row in result["rows"]:
        table.add_row(*(cell(row) for _, cell in columns))
    return table


def markdown_table(result: dict) -> str:
    columns = _columns(result)
    lines = [
        _title(result) + ". Parameters per client; costs per run, mean over seeds.",
        "",
        "| " + " | ".join(header for header, _, _ in columns) + " |",
        "|" + "---|" * len(columns),
        *("| " + " | ".join(cell(row) for _, cell, _ in columns) + " |" for row in result["rows"]),
        "",
        "What each number scored: "
        + "; ".join(f"**{m.label}**: {m.scored}" for m in METRICS if m.key in result["audit"]["scored"])
        + f"; **rounds to**: the first evaluated round at which the seeds' mean local-test reaches "
        f"{result['target']['score']:.2f}% ({result['target']['rule']}). Models: {SELECTION}.",
    ]
    return "\n".join(lines) + "\n"
