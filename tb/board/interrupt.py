"""The interrupt half of a UIO device, played by a simulation over a pseudo-terminal (`PtyInterrupt`)."""

from __future__ import annotations

import os
import select
import struct
import time
import tty

__all__ = ["PtyInterrupt"]

_WORD = struct.Struct("@i")     # /dev/uioN reads and writes one native s32


class PtyInterrupt:
    """``/dev/uioN``'s interrupt protocol over a pseudo-terminal, so that the host's real code path runs: a
    4-byte write re-enables the interrupt, and a blocking 4-byte ``read()`` returns the interrupt count.

    The host opens the slave end, ``slave_path``, in raw mode so every byte passes unchanged. `make_standin`
    links ``dev/uioN`` to it. The simulation holds the master end:

    - the host's 4-byte words (1: enable, 0: disable, as ``uio_pdrv_genirq``'s ``irqcontrol``) arrive on the
      master; `poll` reads them and updates `enabled`;
    - `update` takes the level of the NPU's interrupt line. While the line is high and the interrupt is
      enabled, it delivers one interrupt: `count` goes up by one, the count is written to the master for the
      host's ``read()``, and the interrupt is disabled until the host enables it again. ``uio_pdrv_genirq``
      does the same: its handler disables the level-triggered line, so a line that stays high is delivered
      once per enable.

    The interrupt starts enabled, as the driver requests it at probe. `words` records every word the host
    wrote.
    """

    def __init__(self):
        self.master_fd, self.slave_fd = os.openpty()
        tty.setraw(self.slave_fd)
        self.slave_path = os.ttyname(self.slave_fd)
        self.count = 0
        self.enabled = True
        self.words: list[int] = []
        self._pending = b""

    def poll(self, timeout_s: float = 0.0) -> bool:
        """Read the words the host has written (waiting up to `timeout_s` for the first); return `enabled`."""
        ready, _, _ = select.select([self.master_fd], [], [], timeout_s)
        while ready:
            self._pending += os.read(self.master_fd, 4096)
            ready, _, _ = select.select([self.master_fd], [], [], 0)
        while len(self._pending) >= _WORD.size:
            word = _WORD.unpack(self._pending[:_WORD.size])[0]
            self._pending = self._pending[_WORD.size:]
            self.words.append(word)
            self.enabled = word != 0
        return self.enabled

    def wait_enabled(self, timeout_s: float) -> bool:
        """Block until the host has enabled the interrupt (or `timeout_s` passes); return `enabled`. For a
        simulation that may block: a thread, not a cocotb coroutine."""
        deadline = time.monotonic() + timeout_s
        while not self.poll():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.poll(left)
        return self.enabled

    def update(self, high: bool) -> bool:
        """The interrupt line is `high` (or low). Deliver an interrupt if it is high and enabled; return whether
        one was delivered."""
        if not self.poll() or not high:
            return False
        self.count += 1
        os.write(self.master_fd, _WORD.pack(self.count))
        self.enabled = False
        return True

    def close(self) -> None:
        for fd in (self.master_fd, self.slave_fd):
            if fd is not None:
                os.close(fd)
        self.master_fd = self.slave_fd = None
