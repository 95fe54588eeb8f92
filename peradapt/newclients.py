"""New clients: personalize a client that never took part in training, from a finished run's global model.

`peradapt train --holdout-clients K` keeps the last K client ids out of the federation; their data split is in
partition.json. `personalize_new_client` trains such a client's personalized model from the exported global
model with the run's own method (`Method.personalize_new_client`), measures its local-test accuracy with the
global model before and with the personalized model after, and exports it under `new_clients/<id>/` in the
same layout as `clients/<id>/`, with the accuracies in `new_clients/<id>/result.json`.
"""

from __future__ import annotations

from pathlib import Path

from peradapt.errors import RunError
from peradapt.federation.checkpoint import write_json_atomic
from peradapt.federation.seeds import derive_seed
from peradapt.federation.session import RunPaths, Session
from peradapt.runs import open_run

NEW_CLIENT = 12  # seed phase of a new client's personalization
NEW_CLIENTS_DIR = "new_clients"


def personalize_new_client(run_dir: Path, spec: str) -> dict:
    """Personalize held-out client `spec` of the finished run in `run_dir`; returns what result.json records."""
    paths = RunPaths(run_dir)
    session = open_run(run_dir)
    client_id = _held_out_id(session, spec, run_dir)
    if not paths.global_adapter.is_dir() or not paths.report.is_file():
        raise RunError(
            f"{run_dir} is not finished (no exported global model): finish it with "
            f"`peradapt train --out {run_dir} --resume`"
        )
    global_state = session.model.load_pretrained(paths.global_adapter)
    client = session.data.clients[client_id]
    trainer, config = session.trainer, session.config
    before = trainer.accuracy(global_state, client.test)
    personal = session.method.personalize_new_client(
        client, global_state, derive_seed(config.seed, client_id, NEW_CLIENT)
    )
    after = trainer.accuracy(personal, client.test)
    out = paths.root / NEW_CLIENTS_DIR / str(client_id)
    session.model.save_pretrained(out, personal)
    result = {
        "client": client_id,
        "method": config.method.method,
        "train_samples": len(client.train),
        "test_samples": len(client.test),
        "before": {"model": "global", "local_test": before},
        "after": {"model": "personalized", "local_test": after},
        "adapter": str(out),
    }
    write_json_atomic(out / "result.json", result)
    return result


def _held_out_id(session: Session, spec: str, run_dir: Path) -> int:
    held_out = [client.client_id for client in session.held_out_clients]
    known = ", ".join(map(str, held_out)) if held_out else "none (train with --holdout-clients K to keep K out)"
    try:
        client_id = int(spec)
    except ValueError:
        raise RunError(f"--new-client must be a held-out client id of this run; held-out clients: {known}") from None
    if client_id not in held_out:
        raise RunError(
            f"client {client_id} is not held out in {run_dir}: "
            f"--new-client must be one of the held-out clients: {known}"
        )
    return client_id
