"""The ClientApp: plays the trained clients of a peradapt run on a Flower node (a simulated one or a SuperNode).

A message names the run's directory, the round and the client; the app builds the run's session from that
directory (config.json, partition.json: the same data split, backbone, adapters and method as the server) and
keeps it for the next messages of the process. Each client's private state (PerAda's personalized adapter, APFL's
local model and α, pFedBreD's memory, ...) lives in the run's disk client store, opened for that client at the
round being played (`DiskClientStore.open_client`), so it persists while ClientApps come and go every round, and a
resumed run finds it as of its checkpoint.

Where the run directory is: the node's `--node-config run-dir=DIR` if given (a SuperNode on its own machine: the
server's setup message writes config.json and partition.json there, and the node's clients' store stays there),
else the server's own run directory (simulation, or nodes sharing the server's file system).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from peradapt.compute.costs import own_elements
from peradapt.errors import ConfigError
from peradapt.federation.clients import play_client
from peradapt.federation.session import Session, open_session
from peradapt.flower import records as r
from peradapt.rundir.checkpoint import write_text_atomic
from peradapt.rundir.layout import RunPaths, read_run_config
from peradapt.rundir.store import DiskClientStore

app = ClientApp()

# The sessions of the runs this process served last: building one (data, backbone, adapters) takes seconds, a
# round's message should not. Keyed by everything a session is built from, so a changed run is never served stale;
# a few, for a process that serves several nodes (each with its own run directory) in turn.
_sessions: OrderedDict[tuple, Session] = OrderedDict()
CACHED_SESSIONS = 4


@app.query("setup")
def setup(message: Message, context: Context) -> Message:
    """Write the run's files where this node keeps them, and say which clients the node hosts."""
    node = context.node_config
    if r.PARTITION_ID not in node or r.NUM_PARTITIONS not in node:
        raise ConfigError(
            "this SuperNode has no place in the federation: start it with "
            "--node-config 'partition-id=K num-partitions=N run-dir=DIR' (K = 0 .. N-1, one per node)"
        )
    if r.RUN_DIR in node:
        paths = RunPaths(Path(str(node[r.RUN_DIR])))
        paths.root.mkdir(parents=True, exist_ok=True)
        run = message.content[r.RUN]
        for path, key in ((paths.partition, r.PARTITION_JSON), (paths.config, r.CONFIG_JSON)):
            text = str(run[key])
            if not path.is_file() or path.read_text() != text:
                write_text_atomic(path, text)
    reply = ConfigRecord({r.PARTITION_ID: int(node[r.PARTITION_ID]), r.NUM_PARTITIONS: int(node[r.NUM_PARTITIONS])})
    return Message(RecordDict({r.NODE: reply}), reply_to=message)


@app.train()
def train(message: Message, context: Context) -> Message:
    """Client `client`'s side of round `round` (from 0), from the payload the message holds (the global adapter,
    or the client's own for methods that send each client its own model)."""
    task = message.content[r.TASK]
    session = _session(context, task)
    client_id, round_index = int(task[r.CLIENT]), int(task[r.ROUND])
    _store(session).open_client(client_id, played=round_index, checkpointed=round_index)
    global_state = r.from_record(message.content[r.GLOBAL], session.device)
    update = play_client(session, client_id, global_state, round_index, float(task[r.SHARE]))
    content = RecordDict(
        {
            r.UPLOAD: r.to_record(update.upload),
            r.UPDATE: ConfigRecord(
                {
                    r.NUM_SAMPLES: update.num_samples,
                    r.SAMPLES_TRAINED: update.work.samples,
                    r.ELEMENTS_TRAINED: update.work.trained,
                    r.SECONDS: update.work.seconds,
                }
            ),
            r.METRICS: MetricRecord({name: float(value) for name, value in update.metrics.items()}),
        }
    )
    return Message(content, reply_to=message)


@app.query("personalized")
def personalized(message: Message, context: Context) -> Message:
    """The adapter client `client` is evaluated and exported with, given the global adapter the message holds.

    When the method answers with the global adapter itself, or with the initial adapter (a client it keeps no
    state for), the reply names it instead of sending it: the server holds both, and scores clients that share a
    state in one pass, as the builtin engine does.
    """
    task = message.content[r.TASK]
    session = _session(context, task)
    client_id = int(task[r.CLIENT])
    _store(session).open_client(client_id, played=int(task[r.PLAYED]), checkpointed=int(task[r.CHECKPOINTED]))
    global_state = r.from_record(message.content[r.GLOBAL], session.device)
    state = session.method.personalized(client_id, global_state)
    if state is global_state or state is session.initial:
        same = r.GLOBAL_STATE if state is global_state else r.INITIAL
        content = RecordDict({r.SAME_AS: ConfigRecord({r.SAME_AS: same})})
    else:
        content = RecordDict({r.PERSONALIZED: r.to_record(state)})
    # counted here, where the method's shared tensors are the global state's own (`costs.own_elements`)
    content[r.COUNTS] = ConfigRecord({r.OWN_ELEMENTS: own_elements(state, global_state)})
    return Message(content, reply_to=message)


def _session(context: Context, task: ConfigRecord) -> Session:
    """The run's session, built from its directory with this node's own data directory, weights and device."""
    node = context.node_config
    run_dir = Path(str(node.get(r.RUN_DIR, task[r.RUN_DIR])))
    paths = RunPaths(run_dir)
    overrides = {key: str(node[key]) for key in (r.DATA_DIR, r.WEIGHTS, r.DEVICE) if key in node}
    key = (str(run_dir.resolve()), paths.config.read_text(), tuple(sorted(overrides.items())))
    if key not in _sessions:
        while len(_sessions) >= CACHED_SESSIONS:
            _sessions.popitem(last=False)  # the least recently served goes before the next one is built
        config, _ = read_run_config(run_dir)
        config.data.data_dir = overrides.get(r.DATA_DIR, config.data.data_dir)
        config.backbone.weights = overrides.get(r.WEIGHTS, config.backbone.weights)
        config.device = overrides.get(r.DEVICE, config.device)
        _sessions[key] = open_session(run_dir, config, client_store=paths.client_store)
    _sessions.move_to_end(key)
    return _sessions[key]


def _store(session: Session) -> DiskClientStore:
    assert isinstance(session.store, DiskClientStore), "--engine flower keeps client state on disk"
    return session.store
