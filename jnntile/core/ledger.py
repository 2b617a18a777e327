"""The ledger: what the tiles of each tensor hold at this point of the trace.

Ops are submitted while JAX traces (DESIGN section 1), and some decisions
depend on what earlier calls of the same program did to a tensor's tiles:

* a gradient companion whose zero-fill is *pending*: it must start at zero,
  and the fill is submitted right before the first call that touches it
  (jnntile.ops._ffi.prepare), so no tile of zeros exists before it is needed;
* tiles *invalidated* (memory released, DESIGN invariant 7) must not be read
  until something writes them whole again;
* gradient values *clipped* in place already (`jnntile.grad_of` of a clipped
  `Gradient`), which an optimizer update must not scale a second time.

Each fact is recorded here and nowhere else; ops, differentiation and the
optimizers ask and tell this one object. It outlives a single trace on
purpose: the compiled training step invalidates the gradients every time it
runs, so a trace that comes after it (an evaluation, an eager read) must see
them invalidated too. It learns what a program does only while JAX traces it:
a compiled program that runs again tells it nothing, so whoever runs one and
then traces another on its results tells it what they hold
(jnntile.grad.mark_computed). Entries go with their tensors (weak references).

What is decided per differentiation (which calls touched a tensor, whether
activations are kept) lives in the step scope of jnntile.ops._ffi; what a
transformation says about a gradient (its global-norm clip, that it is summed
over the ranks) travels with the `Gradient` value it returns.
"""

from __future__ import annotations

import weakref

from jnntile.core import runtime


class _Entry:
    __slots__ = ("ref", "zero_pending", "invalidated", "clip")

    def __init__(self, handle):
        self.ref = weakref.ref(handle)
        self.zero_pending = False
        self.invalidated = False
        self.clip = None  # (norm handle, token of the clip) applied to these values in place


class Ledger:
    """The trace-time state of tiles, per tensor handle.

    Keyed by identity: handles compare by value (JAX compares them as static
    pytree data), and a handle of a finished recording may equal a new one.
    """

    def __init__(self):
        self._entries: dict[int, _Entry] = {}

    def _get(self, handle) -> _Entry | None:
        entry = self._entries.get(id(handle))
        return entry if entry is not None and entry.ref() is handle else None

    def _entry(self, handle) -> _Entry:
        entry = self._get(handle)
        if entry is None:
            if len(self._entries) % 1024 == 1023:  # drop the entries of tensors that are gone
                self._entries = {k: e for k, e in self._entries.items() if e.ref() is not None}
            entry = self._entries[id(handle)] = _Entry(handle)
        return entry

    # ---- lazy zero-fills
    def zero_later(self, handle) -> None:
        """`handle` starts at zero; the fill is submitted when a call first touches it."""
        entry = self._entry(handle)
        entry.zero_pending, entry.invalidated, entry.clip = True, False, None

    def zero_pending(self, handle) -> bool:
        entry = self._get(handle)
        return entry is not None and entry.zero_pending

    def take_zero(self, handle) -> bool:
        """True once if `handle`'s zero-fill is pending: the caller submits it (or writes the tiles whole)."""
        entry = self._get(handle)
        if entry is None or not entry.zero_pending:
            return False
        entry.zero_pending = False
        return True

    # ---- invalidation
    def invalidated(self, handle) -> bool:
        entry = self._get(handle)
        return entry is not None and entry.invalidated

    def written(self, handle) -> None:
        """Every tile of `handle` was written: it holds data again."""
        entry = self._get(handle)
        if entry is not None:
            entry.zero_pending, entry.invalidated, entry.clip = False, False, None

    def dropped(self, handle) -> None:
        """The tiles of `handle` were invalidated."""
        entry = self._entry(handle)
        entry.zero_pending, entry.invalidated, entry.clip = False, True, None

    # ---- clips applied in place
    def new_values(self, handle) -> None:
        """`handle` holds new gradient values: no earlier clip applies to them."""
        entry = self._get(handle)
        if entry is not None:
            entry.clip = None

    def clipped(self, handle, norm_handle):
        """The token of the clip by `norm_handle` already applied to `handle`'s values, or None."""
        entry = self._get(handle)
        if entry is None or entry.clip is None or entry.clip[0] is not norm_handle:
            return None
        return entry.clip[1]

    def record_clip(self, handle, norm_handle, token) -> None:
        self._entry(handle).clip = (norm_handle, token)

    def forget_all(self) -> None:
        self._entries.clear()


LEDGER = Ledger()
runtime.before_stop(LEDGER.forget_all)
