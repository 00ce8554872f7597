"""Count the block kernels' forward work while installed: how tests and gpu-check see that a recompute skipped
attention (Selective Checkpoint++) without reading a timer."""

from __future__ import annotations

import functools

from megatron_2d.kernels.base import BlockKernel

_ENTRIES = ("forward", "forward_calls")  # a ring step enters a kernel through one of these


class KernelForwards:
    """Counts every outermost entry into a block kernel's forward (``forward`` or ``forward_calls`` of any
    :class:`BlockKernel` subclass; a ``forward_calls`` that calls ``forward`` counts once), while installed.
    Use as a context manager, or call :meth:`restore`."""

    def __init__(self) -> None:
        self.count = 0
        self._depth = 0
        self._originals: list[tuple[type, str, object]] = []
        todo = [BlockKernel]
        while todo:
            cls = todo.pop()
            todo.extend(cls.__subclasses__())
            for name in _ENTRIES:
                method = cls.__dict__.get(name)
                if method is not None and not getattr(method, "__isabstractmethod__", False):
                    self._wrap(cls, name, method)

    def _wrap(self, cls: type, name: str, original) -> None:
        @functools.wraps(original)
        def counted(*args, **kwargs):
            self.count += self._depth == 0
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        self._originals.append((cls, name, original))
        setattr(cls, name, counted)

    def restore(self) -> None:
        for cls, name, original in reversed(self._originals):
            setattr(cls, name, original)
        self._originals.clear()

    def __enter__(self) -> KernelForwards:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()
