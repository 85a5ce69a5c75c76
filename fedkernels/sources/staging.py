"""Host -> CUDA: a source's column chunks copied to the GPU through two pinned staging buffers and a copy
stream, each copy overlapped with the caller's compute on the previous chunk (:func:`overlapped`)."""

from __future__ import annotations

from typing import Any, Dict, Iterable, Iterator, List, Tuple

import torch

from .matrix import Block


class CudaCalls:
    """The CUDA calls :func:`overlapped` makes (a CPU test drives the same schedule with fake streams
    and events): the caller's (compute) stream, one copy stream per device, pinned and device buffers,
    events."""

    _copy_streams: Dict[torch.device, "torch.cuda.Stream"] = {}

    def __init__(self, device: torch.device):
        self.device = device
        self.compute = torch.cuda.current_stream(device)
        if device not in self._copy_streams:
            self._copy_streams[device] = torch.cuda.Stream(device)
        self.copy = self._copy_streams[device]

    def buffers(self, numel: int, dtype: torch.dtype) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """Two flat pinned host buffers and two flat device buffers of ``numel`` elements."""
        host = [torch.empty(numel, dtype=dtype, pin_memory=True) for _ in range(2)]
        dev = [torch.empty(numel, dtype=dtype, device=self.device) for _ in range(2)]
        for t in dev:  # once freed, their memory also waits for the copy stream's work
            t.record_stream(self.copy)
        return host, dev

    def fill(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)  # host memcpy into pinned memory

    def h2d(self, dst: torch.Tensor, src: torch.Tensor):
        """Copies ``src`` (pinned) to ``dst`` on the copy stream; returns the event of its end."""
        with torch.cuda.stream(self.copy):
            dst.copy_(src, non_blocking=True)
        return self.record(self.copy)

    def record(self, stream):
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait(self, stream, ev) -> None:  # device side: ``stream`` runs on after ``ev``
        stream.wait_event(ev)

    def sync(self, ev) -> None:  # host side: returns after ``ev``
        ev.synchronize()


def overlapped(blocks: Iterable[Block], K: int, width: int, dtype: torch.dtype, cuda) -> Iterator[Block]:
    """Host blocks ``(a, b, [K, b - a])`` (at most ``width`` columns) delivered to the device with the
    copies overlapped: before chunk i is yielded, chunk i+1 is staged into pinned buffer host[(i+1) % 2]
    and its host-to-device copy into dev[(i+1) % 2] is queued on the copy stream, so it runs while the
    caller's kernels on chunk i run on the compute stream. Reuse is ordered by events:

    * host[s] is refilled only after the copy out of it finished (``sync`` on ``copied[s]``, host side);
    * dev[s] is overwritten only after the compute that read it finished (the copy stream waits on
      ``used[s]``, recorded on the compute stream when the caller asks for the next chunk);
    * chunk i is yielded after the compute stream waits on its copy (``copied[s]``).

    A yielded chunk is a contiguous [K, b - a] view of a device buffer, valid until the next one; the
    caller consumes it on the compute stream (the current stream). ``cuda``: :class:`CudaCalls`."""
    host, dev = cuda.buffers(K * width, dtype)
    copied: List[Any] = [None, None]  # event: the last copy host[s] -> dev[s] finished
    used: List[Any] = [None, None]  # event: the compute on the chunk in dev[s] finished

    def issue(i: int, a: int, b: int, c: torch.Tensor):
        s, n = i % 2, K * (b - a)
        if copied[s] is not None:
            cuda.sync(copied[s])  # host[s] is free again
        h, d = host[s][:n].view(K, b - a), dev[s][:n].view(K, b - a)
        cuda.fill(h, c)
        if used[s] is not None:
            cuda.wait(cuda.copy, used[s])  # dev[s] is free again
        copied[s] = cuda.h2d(d, h)
        return a, b, d, s

    it = iter(blocks)
    first = next(it, None)
    cur = None if first is None else issue(0, *first)
    i = 0
    while cur is not None:
        following = next(it, None)
        nxt = None if following is None else issue(i + 1, *following)
        a, b, d, s = cur
        cuda.wait(cuda.compute, copied[s])  # the caller's kernels see the whole chunk
        yield a, b, d
        used[s] = cuda.record(cuda.compute)
        cur, i = nxt, i + 1
