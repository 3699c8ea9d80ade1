"""Lesson 06, sharding: ranks on one machine (`ranks`, the plumbing, with `_rank` run in each process),
collectives counted (`comm`), ZeRO's bytes and labels (`zero`), DeepSpeed and FSDP2 training across ranks
(`zero_train`, also a script for torchrun) and ZeRO at 7B scale on the virtual GPU (`zero_scale`).

`memlab.sharding.run`, `RankGroup` and `CommCounter` are the names the lessons use."""
from .comm import CommCounter, ring_bytes_sent
from .ranks import RankError, RankGroup, RankResult, run

__all__ = ["RankGroup", "RankError", "RankResult", "run", "CommCounter", "ring_bytes_sent"]
