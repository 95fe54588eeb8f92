"""`peradapt export --push-to-hub OWNER/NAME`: an export, with its model cards, uploaded to a Hugging Face model
repository.

Everything a user can get wrong is checked before anything is written or sent: the clients asked for (ids the run
exported), the repository id, a token (`hf auth login` or HF_TOKEN) and HF_HUB_OFFLINE. Then the export is written
(`runs.export_run`, whose cards name the repository) and uploaded with `HfApi.upload_folder`: the backbone, the
global adapter, the chosen clients' adapters and the cards. The upload replaces what an earlier push
put there (its other clients' adapters are deleted), so that the repository holds one export, as its card says.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import HfApi, get_token
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, HTTPError, OfflineModeIsEnabled
from huggingface_hub.utils import validate_repo_id

from peradapt.commands.cards import CARD_FILE, HubTarget, check_license, id_ranges, public_data
from peradapt.commands.finished_run import export_run
from peradapt.errors import ConfigError, HubError, RunError
from peradapt.options import ExportOptions
from peradapt.rundir.layout import read_report, read_run_config
from peradapt.rundir.records import Report

# What an export holds besides the clients' adapters: all of it goes up with every push.
_SHARED_FILES = (CARD_FILE, "backbone.safetensors", "backbone.json", "backbone/*", "global/*")
# What a push replaces in the repository: peradapt's files of an earlier push (never .gitattributes or others).
_REPLACED = ("clients/*", "global/*", "backbone.safetensors", "backbone.json", "backbone/*")


def select_clients(spec: str, report: Report, run_dir: Path) -> tuple[int, ...]:
    """The exported clients that `--clients SPEC` names: `all`, or ids separated by commas (`0,3,5`)."""
    exported = report.clients
    if spec.strip() == "all":
        return tuple(exported)
    known, held_out = set(exported), set(report.held_out_clients or [])
    ids: list[int] = []
    for part in spec.split(","):
        text = part.strip()
        if not text.isdigit():
            raise ConfigError(f"--clients {spec}: '{text}' is no client id; give ids separated by commas, or all")
        client = int(text)
        if client in held_out:
            raise ConfigError(
                f"--clients {spec}: client {client} was held out of training (--holdout-clients) and has no adapter "
                f"to share; `peradapt personalize --run {run_dir} --new-client {client}` trains one"
            )
        if client not in known:
            raise ConfigError(
                f"--clients {spec}: {run_dir} has no client {client}; its clients are {id_ranges(exported)}"
            )
        if client not in ids:
            ids.append(client)
    return tuple(ids)


def push_export(options: ExportOptions) -> str:
    """Export `options.run` to `options.out` (with cards that name the repository; merged, licensed and from the
    weights as `export_run` takes them) and upload it to Hugging Face model repository `options.push_to_hub`
    (created if new, private with `options.private`): backbone, global adapter, the adapters of `options.clients`
    (see `select_clients`; default all) and the cards. Returns the repository's URL."""
    run_dir, out, repo_id, license = options.run, options.out, options.push_to_hub, options.license
    assert repo_id is not None  # `api.push_to_hub` refuses options without one
    read_run_config(run_dir)  # a directory that is no run says so
    report = read_report(run_dir)
    if report is None:
        raise RunError(
            f"{run_dir} is not finished (no report.json): finish it with `peradapt train --out {run_dir} --resume`"
        )
    chosen = select_clients("all" if options.clients is None else options.clients, report, run_dir)
    _check_repo_id(repo_id)
    if license is not None:
        check_license(license)
    _check_can_upload()
    hub = HubTarget(repo_id, chosen)
    export_run(run_dir, out, hub=hub, merge=options.merge, license=license, weights=options.weights)
    whole = set(chosen) == set(report.clients)
    allowed = [*_SHARED_FILES, *(["clients/*"] if whole else [f"clients/{client}/*" for client in chosen])]
    api = HfApi()
    try:
        url = api.create_repo(repo_id, private=True if options.private else None, repo_type="model", exist_ok=True)
        api.upload_folder(
            repo_id=repo_id,
            folder_path=out,
            repo_type="model",
            allow_patterns=allowed,
            delete_patterns=list(_REPLACED),
            commit_message=f"peradapt export of {report.method} on {public_data(report.data)[0]}: global + "
            f"{len(chosen)} client adapters",
        )
    except (HTTPError, OfflineModeIsEnabled) as exc:  # HfHubHTTPError (an answer) is an HTTPError too
        raise HubError(f"cannot upload to {repo_id}: {_why(exc)} (the export in {out} is complete)") from None
    return str(url)


def _check_repo_id(repo_id: str) -> None:
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        repo_id_ok = False
    else:
        repo_id_ok = repo_id.count("/") == 1
    if not repo_id_ok:
        raise ConfigError(
            f"--push-to-hub {repo_id}: give a model repository as OWNER/NAME (your user or organization name, then "
            "letters, digits, '-', '_' or '.')"
        )


def _check_can_upload() -> None:
    if hub_constants.HF_HUB_OFFLINE:
        raise ConfigError("HF_HUB_OFFLINE=1 forbids uploading: unset it to --push-to-hub (or export without it)")
    if get_token() is None:
        raise ConfigError(
            "--push-to-hub needs a Hugging Face token with write access: log in with `hf auth login` or set HF_TOKEN"
        )


def _why(exc: Exception) -> str:
    """One line: why an upload failed, and what to do."""
    status = getattr(getattr(exc, "response", None), "status_code", None) if isinstance(exc, HfHubHTTPError) else None
    if status == 401:
        return "the token was refused (HTTP 401); log in again with `hf auth login` or set HF_TOKEN, then retry"
    if status == 403:
        return "the token may not write there (HTTP 403); use a token with write access to that owner, then retry"
    if status is not None:
        return f"the Hub answered HTTP {status} ({_first_line(exc)}); retry"
    if isinstance(exc, OfflineModeIsEnabled):
        return "HF_HUB_OFFLINE=1 forbids it; unset it and retry"
    return f"cannot reach the Hugging Face Hub ({_first_line(exc)}: no network connection?); retry when connected"


def _first_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
