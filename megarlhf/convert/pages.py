"""A byte range of a file as a tensor over its pages: mapped, not read into fresh memory.

Reading a checkpoint into freshly allocated tensors costs a page fault per 4 KiB page of new
memory on top of the copy; mapping the file's own page-cache pages costs neither (the kernel
maps them several at a time as they are touched). Only the range asked for is mapped,
privately (writes to the tensor never reach the file), and it is unmapped when the tensor
and all its views are freed, so a converter's RSS holds what it is working on, not the file.
"""

from __future__ import annotations

import mmap

import torch


def map_tensor(file, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """`count` elements of `dtype` at byte `offset` of the open binary `file`, as a 1-D
    tensor over the mapped pages."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    pages = mmap.mmap(file.fileno(), offset - start + count * dtype.itemsize,
                      access=mmap.ACCESS_COPY, offset=start)
    return torch.frombuffer(pages, dtype=dtype, count=count, offset=offset - start)
