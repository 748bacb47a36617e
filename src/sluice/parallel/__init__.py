"""Tensor parallelism on torch.distributed: a model split over N processes (ranks).

group.py     the process group, its timeout, and every collective (failures -> ParallelError)
lockstep.py  sluice serve --tp: rank 0 broadcasts each step's adds and aborts, the others follow
plans.py     rank 0 schedules; each step's plan (rows, block tables) goes to the other ranks
sharding.py  which slice of each tensor a rank keeps, and what cannot be split
layers.py    the row-parallel linear, the vocabulary-parallel embedding, OLMo 2's full-width q/k norm
loading.py   a rank's model: sluice's Transformer on the rank's config, filled with its slices only
sampling.py  log Z, greedy and the Sampler over the vocabulary shards, no logits gathered
filters.py   temperature, top_k, top_p and min_p on a rank's columns, cut from merged top values
head.py      what the scheduler does with (B, V/N) logits: samplers, argmax, logprobs
engine.py    the hook behind sluice.LLM(model, tensor_parallel=N)
"""

from .group import ParallelError, Ranks, init, shutdown
from .loading import build_rank_model, load_rank, resident_bytes
from .sampling import ParallelSampler, greedy, log_z
from .sharding import check_shardable, rank_config, vocab_range

__all__ = ["ParallelError", "ParallelSampler", "Ranks", "build_rank_model", "check_shardable", "greedy", "init",
           "load_rank", "log_z", "rank_config", "resident_bytes", "shutdown", "vocab_range"]
