"""What a run costs: the bytes of the states sent, the clients' training samples and FLOPs, seconds and memory.

Counted, not estimated, where counting is exact and cheap:

- bytes: the tensors a state holds, `numel × element size` each (`state_bytes`), as the builtin engine sends them;
- training samples: every sample that goes through a training forward and backward pass on a client, one count per
  pass (`LocalTrainer.samples_trained`): a minibatch that serves two gradients (APFL's w and mixed model,
  pFedMe's K inner steps) counts that many times. Clients trained together (`--concurrent-clients`) count the
  minibatches of their SGD jobs (`sgd_samples`, the same number);
- FLOPs: `torch.utils.flop_counter.FlopCounterMode` over one forward and backward pass of the model, measured once
  per run on two samples (`training_flops`), times the samples counted. Counting every step would slow every step
  for a number that depends on shapes alone.

Seconds and peak memory differ from one run to the next of the same settings: the engine keeps them apart from
the deterministic counts (under a round record's `timing`), so that a resumed run still ends with the very files of
an uninterrupted one but for them.
"""

from __future__ import annotations

import contextlib
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
    """What one client update did: its training samples (see the module's docstring) and wall-clock seconds."""

    samples: int = 0
    seconds: float = 0.0


def state_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """The bytes of the tensors of `state` (an adapter state, a payload, an upload)."""
    return sum(tensor.numel() * tensor.element_size() for tensor in state.values())


def sgd_samples(num_samples: int, batch_size: int, *, epochs: int, steps: int | None = None) -> int:
    """The training samples of `LocalTrainer.minibatches` on `num_samples` samples: `epochs` passes, or with `steps`
    that many minibatches, pass after pass (whose batch sizes `iterate_minibatches` sets, the last one possibly
    joined to the one before)."""
    if steps is None or num_samples == 0:
        return epochs * num_samples if steps is None else 0
    sizes = [len(batch) for batch in iterate_minibatches(num_samples, batch_size, torch.Generator(), shuffle=False)]
    passes, rest = divmod(steps, len(sizes))
    return passes * num_samples + sum(sizes[:rest])


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
