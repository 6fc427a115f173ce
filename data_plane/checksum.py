"""The integrity checksum of a block: CRC-32C (Castagnoli).

Computed once, when a block is committed (or taken from the source when it is
pulled or promoted), kept with the block and sent with every Lookup answer, so
a puller checks what it received without asking the source to read the block
again. ``crc32c`` uses the CPU's CRC instruction (SSE4.2, ARMv8) and releases
the GIL on large buffers: several threads can check one pull's blocks at once.
"""

from __future__ import annotations

from crc32c import crc32c


def checksum(data) -> int:
    """CRC-32C of a buffer (bytes, memoryview, a contiguous numpy array)."""
    return crc32c(data)
