"""Types of the C extension built from native/cpu/kvcopy.c (see kvbridge.blockcopy)."""

from typing import Optional, Sequence

from typing_extensions import Buffer

def hash_blocks(planes: Buffer, ids: Sequence[int], part: int, group: int) -> list[int]: ...
def copy_blocks(dst_planes: Buffer, dst_ids: Sequence[int], src_planes: Buffer, src_ids: Sequence[int], part: int,
                hash: bool) -> Optional[list[int]]: ...
