"""torch.distributed: the ranks of a run (failures shared by every rank, sums across ranks) and sharded
models (FSDP2, tensor parallelism) whose per-rank parts add up to what one process would measure."""
