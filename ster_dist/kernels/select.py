"""Which kernels a rank's layers run (`--kernels triton|native|torch`), chosen once per process when
its engine starts (engine/runner.py), read by the layers where a step picks its path
(model/paged_step.py):

- `native`: today's CPU path, our C++ kernels where they are built (kernels/__init__.py), else
  torch's;
- `torch`: torch's own operations only (the gathered cache and SDPA, torch's products): the
  reference;
- `triton`: the Triton kernels (kernels/triton) where they take the shape, torch's path where not,
  said once.

The default is `triton` on CUDA where triton is installed and `native` elsewhere. A kernel that
cannot take a layer's shape says so once per (kernel, reason) as a progress event and the layer runs
torch's path: never a silently different answer.
"""

from __future__ import annotations

from ster_dist import kernels
from ster_dist.events import progress

CHOICES = ("triton", "native", "torch")

_chosen = "native"
_said: set[tuple[str, str]] = set()


def default_for(device_type: str) -> str:
    """What a rank on `device_type` runs unless asked otherwise."""
    from ster_dist.kernels import triton

    return "triton" if device_type == "cuda" and triton.installed() else "native"


def choose(choice: str | None, device_type: str) -> str:
    """Set this process's kernels (None: the default for `device_type`); refused in one line where
    they cannot run here. Returns the choice made."""
    global _chosen
    choice = choice or default_for(device_type)
    if choice not in CHOICES:
        raise ValueError(f"--kernels {choice!r}: choose one of {', '.join(CHOICES)}")
    if choice == "triton":
        from ster_dist.kernels import triton

        triton.refuse_unless_usable(device_type)
    kernels.allow(choice == "native" or choice == "triton" and device_type == "cpu")
    _chosen = choice
    return choice


def chosen() -> str:
    """This process's kernels: "triton", "native" or "torch"."""
    return _chosen


def fall_back(kernel: str, reason: str) -> None:
    """Say once that `kernel` cannot take what it was asked (`reason`) and that the layer runs
    torch's path."""
    if (kernel, reason) not in _said:
        _said.add((kernel, reason))
        progress(f"the Triton {kernel} kernel cannot take {reason}: that layer runs torch's path")
