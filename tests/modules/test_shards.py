"""The protocol the modules read on a shard of a sequence: what attnkit.distributed gives them
answers it, and every module that can hold a shard starts in one process."""

from __future__ import annotations

import attnkit
from attnkit.distributed import SequenceParallel
from attnkit.modules._shards import SequenceShards
from attnkit.modules.conformer import ConformerConvolution


def test_the_distributed_split_answers_the_protocol() -> None:
    # isinstance() would read world_size, which needs a process group; the members suffice here
    # (mypy checks the signatures where sequence_parallel hands the split to the modules).
    members = {n for n in vars(SequenceShards) if not n.startswith("_")}
    assert members == {"world_size", "segments", "attention", "halo", "all_reduce"}
    for name in members:
        assert type(vars(SequenceParallel)[name]) is type(vars(SequenceShards)[name]), name


def test_modules_start_in_one_process() -> None:
    for module in (
        attnkit.MultiHeadAttention(8, 2),
        attnkit.RelativeMultiHeadAttention(8, 2),
        attnkit.ConformerLayer(8, 2, kernel_size=3),
        ConformerConvolution(8, 3),
    ):
        assert module.sequence_shards is None
