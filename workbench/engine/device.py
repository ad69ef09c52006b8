"""A step's traffic with its device, without waiting for it.

On CUDA, `torch.tensor(list, device=cuda)` copies from pageable memory and synchronizes the
stream, and `.tolist()` waits for all queued work: either one in a step makes the host wait for
the GPU, and the GPU then idles while the host prepares the next step. Here host-to-device copies
go from pinned memory without blocking (the caching host allocator keeps the buffer until the copy
is done), device-to-host copies land in pinned memory behind an event that is waited on only when
the values are read (`Landing`), and a step's parts are timed with CUDA events read after that
wait (`Marks`). On a CPU all of it is the plain synchronous thing.
"""

from __future__ import annotations

import time

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `values` on `device`; on CUDA copied from pinned memory, not waited for."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


class Landing:
    """A device tensor's values on their way to the host: `values()` waits for them (and only
    for the work queued before this copy), then returns them as a list."""

    def __init__(self, tensor: torch.Tensor):
        self.event = None
        if tensor.device.type == "cuda":
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensor

    def values(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class Marks:
    """Points in a step, read as the milliseconds between them once the step's work is done.

    `host(name)` ends a host part (wall time since the previous mark); `device(name)` ends a part
    of the device's work (on CUDA an event: the time the GPU spent between the previous device mark
    and this one, read after a sync, so marking never waits). On a CPU both are wall time."""

    def __init__(self, device: torch.device, after=None):
        """`after`: the previous step's `end_event`; on CUDA the device's idle time from there to
        this step's first device part is read as the part "device_idle" (not one of the step's
        own: the gap async scheduling closes)."""
        self.cuda = device.type == "cuda"
        self.after = after if self.cuda else None
        self.last_host = time.monotonic()
        self.last_event = self._event() if self.cuda else None
        self.host_parts: dict[str, float] = {}
        self.device_parts: list[tuple[str, object, object]] = []  # (name, start event, end event)

    @staticmethod
    def _event():
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def host(self, name: str) -> None:
        now = time.monotonic()
        self.host_parts[name] = self.host_parts.get(name, 0.0) + (now - self.last_host) * 1e3
        self.last_host = now
        if self.cuda:
            self.last_event = self._event()  # the device's next part starts with the work queued from here

    def skip(self) -> None:
        """Leave the host's time since the last mark out of every part (other work)."""
        self.last_host = time.monotonic()

    def device(self, name: str) -> None:
        if not self.cuda:
            self.host(name)
            return
        end = self._event()
        self.device_parts.append((name, self.last_event, end))
        self.last_event = end
        self.last_host = time.monotonic()

    @property
    def end_event(self):
        """The last device part's end (None on a CPU, or none marked): where the device finished
        this step's work."""
        return self.device_parts[-1][2] if self.device_parts else None

    def parts(self) -> dict[str, float]:
        """Each part's milliseconds; on CUDA after the step's work is done (it waits for it)."""
        out = dict(self.host_parts)
        for name, start, end in self.device_parts:
            end.synchronize()
            out[name] = out.get(name, 0.0) + start.elapsed_time(end)
        if self.after is not None and self.device_parts:
            out["device_idle"] = max(0.0, self.after.elapsed_time(self.device_parts[0][1]))
        return out
