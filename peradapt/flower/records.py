"""What the ServerApp and the ClientApps say to each other: message types, record names, adapter conversions.

Only adapter states travel: a state (a flat dict of tensors, `AdapterState`) becomes a Flower ArrayRecord, one
Array per tensor, and back, bit for bit. Settings ride in ConfigRecords, client metrics in MetricRecords.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord

from peradapt.adapters import AdapterState

# Message types: the ClientApp registers one function for each.
SETUP = "query.setup"  # once per node and run: where the run is, which clients the node hosts
TRAIN = "train"  # a sampled client's update from the global adapter
PERSONALIZED = "query.personalized"  # a client's personalized adapter, to evaluate and export on the server

# Records of a message's content.
GLOBAL = "global"  # ArrayRecord: the global adapter, server -> client
TASK = "task"  # ConfigRecord: run directory, round, client
UPLOAD = "upload"  # ArrayRecord: ClientUpdate.upload, client -> server
UPDATE = "update"  # ConfigRecord: ClientUpdate.num_samples and its work (training samples, seconds)
METRICS = "metrics"  # MetricRecord: ClientUpdate.metrics
COUNTS = "counts"  # ConfigRecord: the elements of a personalized adapter that are the client's own
SAME_AS = "same-as"  # ConfigRecord: a personalized adapter that is one the server holds already (no arrays)
NODE = "node"  # ConfigRecord: a node's partition id and count
RUN = "run"  # ConfigRecord: the run's config.json and partition.json, for nodes with a run directory of their own

# Keys in those records, and in a SuperNode's --node-config.
RUN_DIR = "run-dir"
ROUND = "round"
SHARE = "share"  # of its local work a client does (`LocalTrainer.work_share`)
PLAYED = "played"
CHECKPOINTED = "checkpointed"
CLIENT = "client"
NUM_SAMPLES = "num-samples"
SAMPLES_TRAINED = "samples-trained"
ELEMENTS_TRAINED = "elements-trained"  # ClientWork.trained
OWN_ELEMENTS = "own-elements"  # costs.own_elements, as the node counts them
SECONDS = "seconds"
PARTITION_ID = "partition-id"  # Flower's own node-config keys: simulation sets them, SuperNodes are given them
NUM_PARTITIONS = "num-partitions"
DATA_DIR = "data-dir"
WEIGHTS = "weights"
DEVICE = "device"
CONFIG_JSON = "config-json"
PARTITION_JSON = "partition-json"
INITIAL, GLOBAL_STATE = "initial", "global"  # what a SAME_AS record names


def to_record(state: AdapterState) -> ArrayRecord:
    return ArrayRecord({name: tensor.detach().cpu().contiguous() for name, tensor in state.items()})


def from_record(record: ArrayRecord, device: torch.device) -> AdapterState:
    return {name: tensor.to(device) for name, tensor in record.to_torch_state_dict().items()}


def hosts(client_id: int, partition_id: int, num_partitions: int) -> bool:
    """Node `partition_id` of `num_partitions` hosts the clients whose id is its partition id modulo their count:
    one client per node in a simulation of as many nodes as clients, a share of them on each real SuperNode."""
    return client_id % num_partitions == partition_id
