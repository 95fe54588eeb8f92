"""A run's records, typed: report.json (`Report`) and config.json's "resolved" (`Resolved`), read and written here
alone.

Each record is a frozen dataclass whose fields are its file's schema: `from_json` checks a value read from a file
against the fields' annotations (`int`, `float`, which takes whole numbers too, `str`, `list[X]`, `dict[str, X]`, a
nested record, `X | None`: may be null) and refuses a file that departs from them with the one-line damaged-file
RunError (`files.damaged`); `to_json` writes the keys in the order of the fields. A field with a default may be
absent and is not written while it is None (what a run without --dp-noise, a small federation, ... leaves out). A
field's key is its name without a trailing underscore (`global_`: "global"). A field with the metadata `REST` (a
round's method metrics) holds the keys that no other field names, written in its place among them. metrics.jsonl's
lines and a checkpoint's "metrics" are `RoundRecord`s.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from types import UnionType
from typing import Any, Self

from peradapt.rundir.files import damaged, described, is_number, type_name


class _Mismatch(Exception):
    """What in a value departs from its record's fields, said with where it is."""


@dataclass(frozen=True)
class Record:
    """The base of the typed records: `from_json` and `to_json` from the fields (see the module docstring)."""

    @classmethod
    def from_json(cls, data: Any, path: Path, remedy: str, where: str = "") -> Self:
        """The record in `data`, read from `path` (at `where` in it); one that departs from the fields is refused
        naming `remedy`."""
        try:
            return _read(data, cls, where)
        except _Mismatch as exc:
            raise damaged(path, str(exc), remedy) from None

    def to_json(self) -> dict:
        written: dict[str, Any] = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if field.metadata.get(_REST):
                written.update(_written(value))
            elif value is not None or field.default is MISSING:
                written[field.name.rstrip("_")] = _written(value)
        return written


_REST = "rest"
REST = {_REST: True}  # a field's metadata: it holds the keys that no other field names (a dict)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _named(cls: type) -> frozenset[str]:
    """The keys of the fields of `cls` but a `REST` one."""
    return frozenset(field.name.rstrip("_") for field in fields(cls) if not field.metadata.get(_REST))


def _read(value: Any, hint: Any, where: str) -> Any:
    place = where or "its content"
    origin, arguments = typing.get_origin(hint), typing.get_args(hint)
    if origin is UnionType:  # X | None
        return None if value is None else _read(value, arguments[0], where)
    if isinstance(hint, type) and issubclass(hint, Record):
        if not isinstance(value, dict):
            raise _Mismatch(f"{place} is {described(value)}, not an object")
        read = {}
        for field in fields(hint):
            key = field.name.rstrip("_")
            if field.metadata.get(_REST):
                others = {k: v for k, v in value.items() if k not in _named(hint)}
                read[field.name] = _read(others, _hints(hint)[field.name], where)
            elif key in value:
                read[field.name] = _read(value[key], _hints(hint)[field.name], f"{where}.{key}" if where else key)
            elif field.default is MISSING:
                raise _Mismatch(f'{place} has no "{key}"')
        return hint(**read)
    if origin is list:
        if not isinstance(value, list):
            raise _Mismatch(f"{place} is {described(value)}, not a list")
        if arguments[0] in (int, float):  # long lists of numbers: one pass
            bad = next((i for i, v in enumerate(value) if not is_number(v, arguments[0])), None)
            if bad is not None:
                raise _Mismatch(f"{where}[{bad}] is {described(value[bad])}, not {type_name(arguments[0])}")
            return value
        return [_read(item, arguments[0], f"{where}[{index}]") for index, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _Mismatch(f"{place} is {described(value)}, not an object")
        return {key: _read(item, arguments[1], f"{where}.{key}" if where else key) for key, item in value.items()}
    if not (is_number(value, hint) if hint in (int, float) else isinstance(value, hint)):
        raise _Mismatch(f"{place} is {described(value)}, not {type_name(hint)}")
    return value


def _written(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, list):
        return [_written(item) for item in value]
    if isinstance(value, dict):
        return {key: _written(item) for key, item in value.items()}
    return value


@dataclass(frozen=True, kw_only=True)
class Stats(Record):
    """Values over clients (scores, a privacy's ε): their mean and std (`compute.task_metric.mean_and_std`), each
    client's."""

    mean: float
    std: float
    max: float | None = None  # ε: the most a client spent
    per_client: list[float]
    clients: list[int] | None = None  # personalized global-test of a large federation: the clients sampled
    rounds: list[int] | None = None  # selected on test: the round each client's score comes from
    weighted_mean: float | None = None  # local test: weighted by the clients' test images
    worst_10pct: float | None = None  # local test: the mean of the worst 10% of clients


@dataclass(frozen=True, kw_only=True)
class Personalized(Record):
    local_test: Stats
    global_test: Stats


@dataclass(frozen=True, kw_only=True)
class Global(Record):
    local_test: Stats
    global_test: float


@dataclass(frozen=True, kw_only=True)
class Best(Record):
    value: float
    round: int


@dataclass(frozen=True, kw_only=True)
class SelectedOnTest(Record):
    """The authors' reporting: per client its best evaluated round on its own test data (`evaluation.selection`)."""

    rounds_evaluated: list[int]
    personalized_local_test: Stats
    global_global_test: Best


@dataclass(frozen=True, kw_only=True)
class Privacy(Record):
    """--dp-noise: the mechanism's settings and every client's ε (`compute.privacy.privacy_report`)."""

    mechanism: str
    accountant: str
    noise_multiplier: float
    max_grad_norm: float
    delta: float
    epsilon: Stats  # with its max
    steps: list[int]


@dataclass(frozen=True, kw_only=True)
class Parameters(Record):
    """Per client, measured: its model's own elements, the most one client update trained and sent."""

    personalized: int
    trained: int
    communicated: int


@dataclass(frozen=True, kw_only=True)
class Budget(Record):
    """--budget client-samples:N: N, the samples spent, whether the run stopped at it."""

    client_samples: int
    spent: int
    reached: bool


@dataclass(frozen=True, kw_only=True)
class Timing(Record):
    """What differs from run to run of the same settings (`compute.costs`): seconds and peak memory."""

    client_seconds: float
    aggregation_seconds: float
    distillation_seconds: float
    peak_rss_bytes: int
    peak_cuda_bytes: int | None  # None: not on a GPU


@dataclass(frozen=True, kw_only=True)
class Cost(Record):
    """The rounds' costs in total, the final personalization's, the parameter counts and the budget
    (`federation.finish.cost_report`)."""

    rounds_played: int
    bytes_down: int
    bytes_up: int
    bytes_down_per_client_round: float
    bytes_up_per_client_round: float
    client_samples: int
    client_flops: int
    personalization_samples: int
    personalization_flops: int
    server_samples: int
    server_flops: int
    evaluation_samples: int
    evaluation_flops: int
    training_flops_per_sample: int
    inference_flops_per_sample: int
    parameters: Parameters
    budget: Budget | None  # None: no --budget
    timing: Timing


@dataclass(frozen=True, kw_only=True)
class LamAuto(Record):
    """--lam auto: λ chosen once before round 1 from the clients' fitted optima (`methods.auto_lam.estimate_lam`)."""

    r2: float  # max_i ||w*_i - w*_g||²
    r2_median: float
    clients: int  # the clients fitted
    n: float  # samples per client
    m: int  # clients
    rho: float
    lam: float
    regime: str  # homogeneous, moderate or heterogeneous (Theorem 1)
    explanation: str


@dataclass(frozen=True, kw_only=True)
class Resolved(Record):
    """config.json's "resolved": what a run's settings resolved to on the machine that began it
    (`Session.resolved`), and --lam auto's choice."""

    adapter: str  # residual or lora
    scope: str  # what trains: the adapters, the head, ... (`AdaptedModel.scope`)
    client_store: str  # memory or disk
    weights: str  # where the backbone's weights came from
    backbone_sha256: str  # their fingerprint, which every later command checks
    device: str
    num_classes: int
    classes: list[str]
    skipped_images: list[str] | None = None  # --skip-bad-images: the undecodable images left out
    channels: int
    image_size: int
    trainable_parameters: int
    backbone_parameters: int
    versions: dict[str, str]  # python and the packages, and the source commit of peradapt
    lam_auto: LamAuto | None = None


@dataclass(frozen=True, kw_only=True)
class Report(Record):
    """report.json: a finished run's final evaluation (`federation.finish.build_report`)."""

    method: str
    data: str
    metric: str
    eval_split: str  # "validation": every test score is on the clients' validation splits (tuning trials)
    classes: list[str]
    rounds: int  # played: --rounds, or fewer where --budget stopped the run
    seed: int
    clients: list[int]
    personalized: Personalized
    global_: Global
    summary: dict[str, float]
    selected_on_test: SelectedOnTest
    trainable_parameters: int
    backbone_parameters: int
    held_out_clients: list[int] | None = None  # --holdout-clients
    privacy: Privacy | None = None  # --dp-noise
    cost: Cost
    partition_sha256: str  # the clients' data as scored

    def scores(self) -> dict[str, Stats | float]:
        """The final scores under the keys of `summary` and the round records: `personalized_local_test`, ..."""
        return {
            "personalized_local_test": self.personalized.local_test,
            "personalized_global_test": self.personalized.global_test,
            "global_local_test": self.global_.local_test,
            "global_global_test": self.global_.global_test,
        }


@dataclass(frozen=True, kw_only=True)
class PerClient(Record):
    """A round's evaluation client by client, kept for the authors' selection on test data (`evaluation.selection`)."""

    clients: list[int]
    personalized_local_test: list[float]
    global_local_test: list[float]


@dataclass(frozen=True, kw_only=True)
class ParameterCounts(Record):
    """Per client, the most of a round's updates: the elements it trained and those it sent (`Parameters`)."""

    trained: int
    communicated: int


@dataclass(frozen=True, kw_only=True)
class RoundCost(Record):
    """A round's totals: deterministic, identical on --resume; report.json's `cost` sums them over the rounds."""

    bytes_down: int
    bytes_up: int
    client_samples: int
    client_flops: int
    server_samples: int  # the server's distillation: the student's training samples
    server_flops: int  # and all of it (the teachers' inference too) in FLOPs
    evaluation_samples: int  # the personalization that scoring the clients after the round took (--eval-every)
    evaluation_flops: int

    @staticmethod
    def totals(costs: list[RoundCost]) -> dict[str, int]:
        """Each field summed over `costs`."""
        return {field.name: sum(getattr(cost, field.name) for cost in costs) for field in fields(RoundCost)}


@dataclass(frozen=True, kw_only=True)
class RoundTiming(Record):
    """What differs from run to run of the same settings (`compute.costs`); report.json's `timing` sums the
    seconds and takes the peaks."""

    client_seconds: float
    aggregation_seconds: float
    distillation_seconds: float
    peak_rss_bytes: int
    peak_cuda_bytes: int | None = None  # on a GPU


@dataclass(frozen=True, kw_only=True)
class RoundRecord(Record):
    """A round (`FederatedRun.play_round`): a line of metrics.jsonl, an entry of a checkpoint's "metrics"."""

    round: int
    clients: list[int]  # sampled, in the order they are aggregated
    # the method's own: its clients' means (`ClientUpdate.metrics`) and the server's
    metrics: dict[str, float] = dataclasses.field(default_factory=dict, metadata=REST)
    # How many clients trained, where they are not `clients`: the method trains every federated client (pFedMe,
    # pFedBreD unless --train-clients sampled), or --participation left some `unanswered`. The per-client lists
    # below (`bytes_down`, `bytes_up`, `client_samples`) have an entry per client that trained, in the order it was
    # asked: `clients`, or all federated clients in id order, less the `unanswered`.
    trained_clients: int | None = None
    unanswered: list[int] | None = None  # --participation: the clients asked that did not answer
    stragglers: dict[str, float] | None = None  # --stragglers: client id -> the share of its work it did
    budget_share: float | None = None  # --budget: the share of their work the last round's clients did
    dp_epsilon: list[float] | None = None  # --dp-noise: the ε each aggregated client has spent so far
    # --eval-every: the evaluation after the round (`evaluation.flat_scores`)
    personalized_local_test: float | None = None
    personalized_local_test_std: float | None = None
    personalized_global_test: float | None = None
    personalized_global_test_std: float | None = None
    global_local_test: float | None = None
    global_local_test_std: float | None = None
    global_global_test: float | None = None
    per_client: PerClient | None = None
    bytes_down: list[int]
    bytes_up: list[int]
    bytes_full_model: int | None = None  # --engine flower: the full model's size
    bytes_evaluation: int | None = None  # --engine flower: the evaluation's personalized-adapter exchanges
    parameter_counts: ParameterCounts | None = None  # None: no client trained
    client_samples: list[int]
    cost: RoundCost
    timing: RoundTiming


@dataclass(frozen=True, kw_only=True)
class CheckpointMeta(Record):
    """A round checkpoint's JSON metadata (`rundir.checkpoint`): the records of the rounds so far."""

    metrics: list[RoundRecord]
