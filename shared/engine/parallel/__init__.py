"""Tensor parallelism of the engine: the collectives over torch.distributed, the per-step broadcast of the
batch, rank 0's side of the rank processes and the worker ranks' own process."""
