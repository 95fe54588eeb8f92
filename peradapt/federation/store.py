"""Per-client private state that persists across rounds (e.g. PerAda's personalized adapters)."""

from __future__ import annotations

import torch

from peradapt.adapters import AdapterState, state_to, state_to_cpu

_SEPARATOR = "/"


class ClientStore:
    """Client states in memory, keyed by (client id, name), e.g. (3, "personal")."""

    def __init__(self) -> None:
        self._states: dict[tuple[int, str], AdapterState] = {}

    def get(self, client_id: int, key: str) -> AdapterState | None:
        return self._states.get((client_id, key))

    def put(self, client_id: int, key: str, state: AdapterState) -> None:
        self._states[(client_id, key)] = state

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Flat `clients/<id>/<key>/<tensor name>` dict, for checkpoints."""
        flat = {}
        for (client_id, key), state in self._states.items():
            for name, tensor in state_to_cpu(state).items():
                flat[_SEPARATOR.join(("clients", str(client_id), key, name))] = tensor
        return flat

    def load_tensors(self, flat: dict[str, torch.Tensor], device: torch.device) -> None:
        """Restore from a checkpoint's tensors, ignoring those that are not client state (e.g. `global/...`)."""
        grouped: dict[tuple[int, str], AdapterState] = {}
        prefix = "clients" + _SEPARATOR
        for full_name, tensor in flat.items():
            if full_name.startswith(prefix):
                client_id, key, name = full_name[len(prefix) :].split(_SEPARATOR, 2)
                grouped.setdefault((int(client_id), key), {})[name] = tensor
        self._states = {slot: state_to(state, device) for slot, state in grouped.items()}
