"""peradapt's methods as a Flower strategy: the messages of each protocol step, and what their replies mean.

One hook pair per step, named as Flower's strategies name theirs (`configure_*` builds the messages to the nodes,
`aggregate_*` reads the replies); the exchange itself, and the round loop around it, are the server's:

- setup: every node learns where the run is (and, with a run directory of its own, receives config.json and
  partition.json); it answers with its partition id and count, which say the clients it hosts (`records.hosts`).
- train: each trained client's node (the sampled clients', or every client's for methods that train all) gets
  the client's payload (`Method.payload`: the global adapter, or MTL's model of its own) and plays the client's
  update; it answers with the upload (`ClientUpdate.upload`: the local adapter, APFL's w_m, a partial method's
  shared part, ...), its sample count, its losses and its work (training samples and seconds, as `play_client`
  measures them on the node). `Method.server_update` then runs on the server, as in the builtin engine.
- personalized: for evaluation and export, a client's node gets the global adapter and answers with the adapter
  the client is evaluated with (`Method.personalized`), or names the global or initial adapter if it is one.

Every array sent is counted, both ways, and reported for the round's record beside the size of the full model
(the frozen backbone with its head), which full-model federated learning would send instead. Counted as Flower
sends them (`ArrayRecord.count_bytes`): each array's serialized bytes (NumPy's .npy format: the data and a header
of about 128 bytes) and its name; the builtin engine counts the tensors' bytes alone (`costs.state_bytes`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from peradapt.adapters import AdapterState
from peradapt.compute.costs import ClientWork
from peradapt.errors import ConfigError
from peradapt.federation.clients import RoundTask
from peradapt.federation.session import Session
from peradapt.flower import records as r
from peradapt.methods import ClientUpdate
from peradapt.rundir.layout import RunPaths


class PeradaptStrategy:
    def __init__(self, session: Session, run_dir: Path) -> None:
        self.session = session
        self.run_dir = str(run_dir.resolve())
        self.nodes: dict[int, tuple[int, int]] = {}  # node id -> (partition id, number of partitions)
        self.full_model_bytes = r.to_record(session.model.backbone_state()).count_bytes()
        self._down: dict[int, int] = {}  # this round's training messages, bytes per client
        self._up: dict[int, int] = {}
        self._evaluation = 0  # bytes of this round's personalized-adapter exchanges, both ways
        self.own_elements: dict[int, int] = {}  # of each client's personalized adapter, as its node counted them

    # ------------------------------------------------------------ setup

    def configure_setup(self, node_ids: Iterable[int]) -> list[tuple[int, Message]]:
        paths = RunPaths(Path(self.run_dir))
        run = ConfigRecord({r.CONFIG_JSON: paths.config.read_text(), r.PARTITION_JSON: paths.partition.read_text()})
        content = RecordDict({r.RUN: run})
        return [(node, Message(content, dst_node_id=node, message_type=r.SETUP)) for node in node_ids]

    def aggregate_setup(self, replies: dict[int, Message]) -> None:
        for node, reply in replies.items():
            answer = reply.content[r.NODE]
            self.nodes[node] = (int(answer[r.PARTITION_ID]), int(answer[r.NUM_PARTITIONS]))

    def unhosted(self, client_ids: Sequence[int]) -> list[int]:
        """The clients that no node known so far hosts; refuses nodes that disagree on the partitioning."""
        counts = {count for _, count in self.nodes.values()}
        if len(counts) > 1:
            raise ConfigError(f"SuperNodes were started with different num-partitions ({sorted(counts)}): use one N")
        partitions = [partition for partition, _ in self.nodes.values()]
        if len(set(partitions)) < len(partitions):
            raise ConfigError("two SuperNodes were started with the same partition-id: give each its own")
        return [c for c in client_ids if self.node_of(c) is None]

    def node_of(self, client_id: int) -> int | None:
        for node, (partition, count) in self.nodes.items():
            if r.hosts(client_id, partition, count):
                return node
        return None

    # ------------------------------------------------------------ train

    def configure_train(self, task: RoundTask) -> list[tuple[int, Message]]:
        """A message per trained client with its payload, its round and the share of its local work it does;
        clients sent the same state object (most often the global adapter, sent to all) share one record, which a
        SuperLink stores once."""
        records: dict[int, ArrayRecord] = {}
        for client in task.trained:
            state = task.payloads[client]
            if id(state) not in records:
                records[id(state)] = r.to_record(state)
        arrays = {client: records[id(task.payloads[client])] for client in task.trained}
        self._down = {client: arrays[client].count_bytes() for client in task.trained}
        self._up, self._evaluation = {}, 0
        return [
            (
                client,
                self._message(
                    r.TRAIN,
                    client,
                    arrays[client],
                    {r.ROUND: task.round_index, r.CLIENT: client, r.SHARE: task.share(client)},
                ),
            )
            for client in task.trained
        ]

    def aggregate_train(self, trained: Sequence[int], replies: dict[int, Message]) -> list[ClientUpdate]:
        """The trained clients' updates, in the order of `trained` (the order the builtin engine plays them in)."""
        updates = []
        for client in trained:
            content = replies[client].content
            upload: ArrayRecord = content[r.UPLOAD]
            self._up[client] = upload.count_bytes()
            metrics = {name: float(value) for name, value in content[r.METRICS].items()}
            answer = content[r.UPDATE]
            work = ClientWork(  # as the node measured it
                int(answer[r.SAMPLES_TRAINED]), float(answer[r.SECONDS]), int(answer[r.ELEMENTS_TRAINED])
            )
            state = r.from_record(upload, self.session.device)
            updates.append(ClientUpdate(client, state, int(answer[r.NUM_SAMPLES]), metrics, work))
        return updates

    # ------------------------------------------------------------ personalized adapters

    def configure_personalized(
        self, clients: Sequence[int], global_arrays: ArrayRecord, *, played: int, checkpointed: int
    ) -> list[tuple[int, Message]]:
        self._evaluation += len(clients) * global_arrays.count_bytes()
        task = {r.PLAYED: played, r.CHECKPOINTED: checkpointed}
        return [
            (client, self._message(r.PERSONALIZED, client, global_arrays, {**task, r.CLIENT: client}))
            for client in clients
        ]

    def aggregate_personalized(
        self, replies: dict[int, Message], global_state: AdapterState
    ) -> dict[int, AdapterState]:
        states = {}
        for client, reply in replies.items():
            self.own_elements[client] = int(reply.content[r.COUNTS][r.OWN_ELEMENTS])
            if r.SAME_AS in reply.content:
                named = reply.content[r.SAME_AS][r.SAME_AS]
                states[client] = global_state if named == r.GLOBAL_STATE else self.session.initial
            else:
                arrays: ArrayRecord = reply.content[r.PERSONALIZED]
                self._evaluation += arrays.count_bytes()
                states[client] = r.from_record(arrays, self.session.device)
        return states

    # ------------------------------------------------------------ accounting

    def traffic(self) -> dict:
        """The round's bytes: sent to (`bytes_down`) and by (`bytes_up`) each client of its training, in the order
        they were asked (see `RoundRecord.trained_clients`); all personalized-adapter exchanges of its evaluation
        (`bytes_evaluation`); and the full model's size (`bytes_full_model`)."""
        sampled = list(self._down)
        record = {
            "bytes_down": [self._down[c] for c in sampled],
            "bytes_up": [self._up.get(c, 0) for c in sampled],
            "bytes_full_model": self.full_model_bytes,
        }
        if self._evaluation:
            record["bytes_evaluation"] = self._evaluation
        self._down, self._up, self._evaluation = {}, {}, 0
        return record

    def _message(self, message_type: str, client: int, arrays: ArrayRecord, task: dict) -> Message:
        node = self.node_of(client)
        assert node is not None, f"client {client} has no node: FlowerClients connects them first"
        content = RecordDict({r.GLOBAL: arrays, r.TASK: ConfigRecord({r.RUN_DIR: self.run_dir, **task})})
        return Message(content, dst_node_id=node, message_type=message_type)
