"""What a run costs: the bytes of the states sent, the clients' training samples and FLOPs, seconds and memory.

Counted, not estimated, where counting is exact and cheap:

- bytes: the tensors a state holds, `numel × element size` each (`state_bytes`), as the builtin engine sends them;
- training samples: every sample that goes through a training forward and backward pass on a client, one count per
  pass (`LocalTrainer.samples_trained`): a minibatch that serves two gradients (APFL's w and mixed model,
  pFedMe's K inner steps) counts that many times. Clients trained together (`--concurrent-clients`) count the
  minibatches of their SGD jobs (`sgd_samples`, the same number);
- FLOPs: `torch.utils.flop_counter.FlopCounterMode` over one forward and backward pass of the model (one forward
  pass for inference: `inference_flops`), measured once per run on two samples (`training_flops`), times the
  samples counted. Counting every step would slow every step for a number that depends on shapes alone;
- the server's distillation (`Distiller.samples_trained`, `samples_inferred`): the student's training samples and
  the samples of its inference passes (teachers' logits, validation checks), priced the same way;
- personalization outside the rounds: what a method trains when it hands out a client's model (fedavg-ft's
  fine-tuning, `Method.personalization_samples`), and a new client's personalization.

Seconds and peak memory differ from one run to the next of the same settings: the engine keeps them apart from
the deterministic counts (under a round record's `timing`), so that a resumed run still ends with the very files of
an uninterrupted one but for them.
"""

from __future__ import annotations

import contextlib
import math
import resource
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from peradapt.data import iterate_minibatches


@dataclass
class ClientWork:
    """What one client update did: its training samples (see the module's docstring), wall-clock seconds, and the
    elements of the parameters it trained (`LocalTrainer.count_trained`: each state it trains counted once, e.g.
    PerAda's v_m and θ_m twice the adapter)."""

    samples: int = 0
    seconds: float = 0.0
    trained: int = 0


@dataclass(frozen=True)
class ServerWork:
    """The server's work so far beyond averaging (distillation): the samples it trained the student on, those it
    passed through teachers, and its seconds (`Method.server_work`)."""

    samples_trained: int = 0
    samples_inferred: int = 0
    seconds: float = 0.0

    def __sub__(self, before: ServerWork) -> ServerWork:
        return ServerWork(
            self.samples_trained - before.samples_trained,
            self.samples_inferred - before.samples_inferred,
            self.seconds - before.seconds,
        )


def elements(state: Mapping[str, torch.Tensor]) -> int:
    """The elements of the floating-point tensors of `state` (parameters, running statistics, a method's extra
    entries; not integer counters)."""
    return sum(tensor.numel() for tensor in state.values() if tensor.is_floating_point())


def own_elements(personalized: Mapping[str, torch.Tensor], global_state: Mapping[str, torch.Tensor]) -> int:
    """The elements of a client's model (`personalized`, as the method hands it out) that are its own: every tensor
    that is not the global model's own tensor object (a method returns the global state's tensors for what it
    shares: FedAvg all of them, a partial model its shared part). With the elements a client update trains
    (`ClientWork.trained`) and those of one upload (`elements`: extra entries such as SCAFFOLD's Δc, and running
    statistics, included), the per-client counts of the PerAda paper's Table 1, measured rather than declared."""
    shared = {id(tensor) for tensor in global_state.values()}
    return elements({name: tensor for name, tensor in personalized.items() if id(tensor) not in shared})


@dataclass(frozen=True)
class SampleFlops:
    """FLOPs per sample of the run's model: a training step's forward and backward pass (`training_flops`) and an
    inference pass (`inference_flops`)."""

    training: int
    inference: int


def state_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """The bytes of the tensors of `state` (an adapter state, a payload, an upload)."""
    return sum(tensor.numel() * tensor.element_size() for tensor in state.values())


def sgd_samples(num_samples: int, batch_size: int, *, epochs: int, steps: int | None = None, share: float = 1.0) -> int:
    """The training samples of `LocalTrainer.minibatches` on `num_samples` samples: `epochs` passes, or with `steps`
    that many minibatches, pass after pass (whose batch sizes `iterate_minibatches` sets, the last one possibly
    joined to the one before); with `share` below 1, the part of them a client doing that share of its work trains
    (`shared_sizes`)."""
    if share >= 1 and steps is None:
        return epochs * num_samples
    return sum(shared_sizes(schedule_sizes(num_samples, batch_size, epochs=epochs, steps=steps), share))


def schedule_sizes(num_samples: int, batch_size: int, *, epochs: int, steps: int | None = None) -> list[int]:
    """The sizes of the minibatches `LocalTrainer.index_batches` draws, in order (which samples they hold is
    shuffled; their sizes are not)."""
    if num_samples == 0:
        return []
    sizes = [len(batch) for batch in iterate_minibatches(num_samples, batch_size, torch.Generator(), shuffle=False)]
    return [sizes[i % len(sizes)] for i in range(len(sizes) * epochs if steps is None else steps)]


def shared_sizes(sizes: list[int], share: float) -> list[int]:
    """The minibatch sizes of a client that does `share` (in [0, 1]) of a job whose minibatches have `sizes`: its
    first floor(share x their samples) samples, in the same order, the last batch cut short; a cut batch of a
    single sample is left out (a training BatchNorm cannot normalize one sample). All of them at a share of 1."""
    if share >= 1:
        return sizes
    allowed, kept = math.floor(share * sum(sizes)), []
    for size in sizes:
        take = min(size, allowed)
        if take == 0 or (take == 1 < size):
            break
        kept.append(take)
        allowed -= take
    return kept


def training_flops(forward: Callable[[torch.Tensor], torch.Tensor], inputs: torch.Tensor, parameters: Iterable) -> int:
    """FLOPs per sample of one forward pass of `forward` on `inputs` and the backward pass to `parameters` (the ones
    that train: a frozen layer costs no weight gradient, nor an input gradient below the first trained one).

    Counted by `FlopCounterMode`: matrix products, convolutions and attention, both ways; not the elementwise
    operations (activations, normalizations, the loss) nor the optimizer's step, which are a small share of a
    convolutional or transformer network's. The gradient is taken of the outputs' sum: a loss adds only
    elementwise work. `inputs` should hold at least two samples (a training BatchNorm refuses one)."""
    parameters = [parameter for parameter in parameters if parameter.requires_grad]
    with FlopCounterMode(display=False) as counter:
        outputs = forward(inputs)
        torch.autograd.grad(outputs.float().sum(), parameters)
    return counter.get_total_flops() // len(inputs)


def inference_flops(forward: Callable[[torch.Tensor], torch.Tensor], inputs: torch.Tensor) -> int:
    """FLOPs per sample of one forward pass of `forward` on `inputs` without gradients (`training_flops`'s
    counting)."""
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        forward(inputs)
    return counter.get_total_flops() // len(inputs)


_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def reset_peak_memory() -> None:
    """Start the peaks that `peak_memory` reports from now, for a run of its own in a process that ran others
    (`compare`, the API): Linux resets the process's high-water mark (VmHWM) to its present size when "5" is
    written to /proc/self/clear_refs; every GPU's peak is reset. Elsewhere (macOS) the resident peak stays the
    process's since its start."""
    with contextlib.suppress(OSError):
        _CLEAR_REFS.write_text("5")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(index)


def peak_memory(device: torch.device) -> dict[str, int]:
    """The peak resident memory since the last `reset_peak_memory` (Linux; elsewhere the process's) and, on a
    GPU, the most memory its tensors held since then."""
    peaks = {"peak_rss_bytes": _peak_rss_bytes()}
    if device.type == "cuda":
        peaks["peak_cuda_bytes"] = torch.cuda.max_memory_allocated(device)
    return peaks


def _peak_rss_bytes() -> int:
    with contextlib.suppress(OSError):
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux says kibibytes, macOS bytes
