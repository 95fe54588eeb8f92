"""Per-client private state that persists across rounds (e.g. PerAda's personalized adapters).

Methods `get` and `put` a client's state by (client id, name); a client never sampled has none, and methods fall
back to the initial state. The engine makes the store consistent with its round checkpoints through three calls:
`checkpoint_tensors` (what the checkpoint must carry), `commit` (the checkpoint after round R is on disk) and
`restore` (start from the checkpoint after round R, or from nothing at R = 0).

`ClientStore` keeps every state in memory and in every checkpoint: right for small federations, whose run
directory then holds nothing else. `DiskClientStore` keeps one safetensors file per (client, name) under
`RUN/client_store/`, so memory holds only the states of the clients being trained or evaluated, and a checkpoint
holds only the global adapter: its cost per round does not grow with the number of clients.

Crash consistency of the disk store: files are versioned by round, and the checkpoint's round says which version
is current. A `put` during round r writes `<client>.<name>.r<r>.safetensors` (to a temporary file, then
`os.replace`: a reader sees the old file or the new one, never half of one). The version it supersedes stays until
the checkpoint after round r is written; `commit(r)` deletes it then. `restore(R)` deletes every version newer than
R (a round the checkpoint never recorded), every version but the newest of each state (a commit cut short) and
every other file (temporary files of interrupted writes: the directory belongs to the store; a directory in it is
not the store's, and refused, never deleted). So after a crash or
`kill -9` anywhere, a resumed run sees exactly the states of its checkpoint, replays the lost round with the same
seeds, rewrites the same files, and ends with the files an uninterrupted run writes. Like the checkpoints, nothing
is fsynced: this protects against a killed process, not a lost disk cache.

Under `--engine flower` the clients' states are written by ClientApps, in other processes or on other machines, one
client at a time: each opens its client with `open_client`, which applies the same rules to that client's files,
given the round being played and the newest checkpoint's (the server says both in its message).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import ClassVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from peradapt.adapters import AdapterState, state_to, state_to_cpu
from peradapt.errors import RunError, writing
from peradapt.rundir.files import damaged

_SEPARATOR = "/"
_DISK_FILE = re.compile(r"(?P<client>\d+)\.(?P<key>\w+)\.r(?P<round>\d+)\.safetensors")
_TEMPORARY = ".tmp"


class ClientStore:
    """Client states in memory, keyed by (client id, name), e.g. (3, "personal"); checkpoints carry them all.

    A method's `self.store` is one of these or a `DiskClientStore` (--client-store disk), and uses `get` and `put`
    alone: the engine makes the states consistent with the checkpoints."""

    kind: ClassVar[str] = "memory"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._states: dict[tuple[int, str], AdapterState] = {}

    def get(self, client_id: int, key: str) -> AdapterState | None:
        """The state last `put` as (`client_id`, `key`), or None if there is none (a client never trained): the
        method falls back to its initial value (`context.initial`, zeros, ...)."""
        return self._states.get((client_id, key))

    def _foreign_directory(self, path: str) -> RunError:
        return RunError(
            f"{path} is a directory inside the client store {self.directory}, which holds only the store's own "
            "files (any other file there is deleted on --resume): move it out of there"
        )

    def put(self, client_id: int, key: str, state: AdapterState) -> None:
        """Keep `state` (named tensors) as client `client_id`'s `key` (letters, digits and _; a method's own keys
        prefixed with its name: "scaffold_control"), replacing the one before. It is in the next checkpoint, and
        --resume restores it; with --client-store disk it is written to a file at once."""
        self._states[(client_id, key)] = state

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Flat `clients/<id>/<key>/<tensor name>` dict: what a round checkpoint needs to restore the store."""
        flat = {}
        for (client_id, key), state in self._states.items():
            for name, tensor in state_to_cpu(state).items():
                flat[_SEPARATOR.join(("clients", str(client_id), key, name))] = tensor
        return flat

    def restore(self, tensors: dict[str, torch.Tensor], completed_rounds: int) -> None:
        """The states of the checkpoint after `completed_rounds` rounds, from its tensors (others, such as
        `global/...`, are ignored); no tensors and round 0 for a run that starts afresh."""
        grouped: dict[tuple[int, str], AdapterState] = {}
        prefix = "clients" + _SEPARATOR
        for full_name, tensor in tensors.items():
            if full_name.startswith(prefix):
                client_id, key, name = full_name[len(prefix) :].split(_SEPARATOR, 2)
                grouped.setdefault((int(client_id), key), {})[name] = tensor
        self._states = {slot: state_to(state, self.device) for slot, state in grouped.items()}

    def commit(self, completed_rounds: int) -> None:
        """The checkpoint after `completed_rounds` rounds is written (it holds every state already)."""


class DiskClientStore(ClientStore):
    """One safetensors file per (client, name) and round version under `directory`; see the module docstring."""

    kind: ClassVar[str] = "disk"

    def __init__(self, directory: Path, device: torch.device | str = "cpu") -> None:
        super().__init__(device)
        self.directory = Path(directory)
        self._round = 1  # the round being played: the version that `put` writes
        self._current: dict[tuple[int, str], int] = {}  # the version `get` reads: an int per state, no tensors
        self._superseded: list[Path] = []  # deleted once the checkpoint of the round being played is written

    def path(self, client_id: int, key: str, version: int) -> Path:
        return self.directory / f"{client_id}.{key}.r{version:05d}.safetensors"

    def get(self, client_id: int, key: str) -> AdapterState | None:
        version = self._current.get((client_id, key))
        if version is None:
            return None
        path = self.path(client_id, key, version)
        try:
            return load_file(str(path), device=str(self.device))
        except (SafetensorError, OSError) as exc:
            raise damaged(path, f"not a readable safetensors file: {exc}", self._remedy()) from None

    def _remedy(self) -> str:
        """What to do about a damaged state: the store keeps no other copy, so the run is redone (its directory is
        RUN/client_store, next to RUN/checkpoints)."""
        run = self.directory.parent
        return (
            f"the client states are kept nowhere else, so delete {self.directory} and {run / 'checkpoints'} and run "
            f"`peradapt train --out {run} --resume` to redo the run from round 1"
        )

    def put(self, client_id: int, key: str, state: AdapterState) -> None:
        if not re.fullmatch(r"\w+", key):
            raise ValueError(f"client state names are letters, digits and _, got {key!r}")
        slot = (client_id, key)
        path = self.path(client_id, key, self._round)
        self.directory.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(_TEMPORARY)
        with writing(temporary):  # `restore` deletes a half-written temporary file (the module docstring)
            save_file(state_to_cpu(state), str(temporary))
        os.replace(temporary, path)
        previous = self._current.get(slot)
        if previous is not None and previous != self._round:
            self._superseded.append(self.path(client_id, key, previous))
        self._current[slot] = self._round

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return {}  # the files are the state; the checkpoint's round says which versions count

    def restore(self, tensors: dict[str, torch.Tensor], completed_rounds: int) -> None:
        """Make the directory hold exactly the versions current after round `completed_rounds`. It is checked
        before anything is deleted: a directory inside it (not the store's: never deleted), or a current version
        that is no whole safetensors file, is a RunError."""
        self._round, self._current, self._superseded = completed_rounds + 1, {}, []
        if not self.directory.is_dir():
            return
        versions: dict[tuple[int, str], list[int]] = {}
        stale = []  # written in a round that no checkpoint recorded, or a write that a crash interrupted
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    raise self._foreign_directory(entry.path)
                match = _DISK_FILE.fullmatch(entry.name)
                if match is None or int(match["round"]) > completed_rounds:
                    stale.append(entry.path)
                else:
                    versions.setdefault((int(match["client"]), match["key"]), []).append(int(match["round"]))
        current = {slot: max(found) for slot, found in versions.items()}
        for (client_id, key), version in current.items():
            path = self.path(client_id, key, version)
            try:
                with safe_open(str(path), framework="pt"):  # the header alone: it also says the file is whole
                    pass
            except (SafetensorError, OSError) as exc:
                raise damaged(path, f"not a readable safetensors file: {exc}", self._remedy()) from None
        for path in stale:
            os.unlink(path)
        for (client_id, key), found in versions.items():
            for version in found:
                if version != current[(client_id, key)]:  # superseded: its round's commit was cut short
                    self.path(client_id, key, version).unlink()
        self._current = current

    def commit(self, completed_rounds: int) -> None:
        for path in self._superseded:
            path.unlink(missing_ok=True)
        self._superseded = []
        self._round = completed_rounds + 1

    def open_client(self, client_id: int, *, played: int, checkpointed: int) -> None:
        """Serve client `client_id` alone, with its states as of round `played`, in a run whose newest checkpoint
        is after round `checkpointed` (`played` or `played - 1`); a `put` then writes version `played + 1`.

        For a process that plays one client at a time while another (the server) owns the checkpoints: Flower's
        ClientApps. It applies `restore`'s rules to this client's files only, so processes serving other clients
        of the same directory at the same time are untouched: versions newer than `played` (written in a round no
        checkpoint recorded) and interrupted writes are deleted, and versions superseded by one that a checkpoint
        covers. The newest version up to `checkpointed` stays until the next checkpoint covers a newer one.
        """
        self._round, self._current, self._superseded = played + 1, {}, []
        if not self.directory.is_dir():
            return
        prefix = f"{client_id}."
        versions: dict[str, list[int]] = {}
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if not entry.name.startswith(prefix):
                    continue
                if entry.is_dir(follow_symlinks=False):
                    raise self._foreign_directory(entry.path)
                match = _DISK_FILE.fullmatch(entry.name)
                if match is None or int(match["round"]) > played:
                    os.unlink(entry.path)
                else:
                    versions.setdefault(match["key"], []).append(int(match["round"]))
        for key, found in versions.items():
            newest = max(found)
            self._current[(client_id, key)] = newest
            covered = max((v for v in found if v <= checkpointed), default=None)  # what a resume would read
            for version in found:
                if version not in (newest, covered):
                    self.path(client_id, key, version).unlink()
