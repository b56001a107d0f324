"""The engine core: requests, the paged block pool, the scheduler, the runner, the step loop,
sampling and detokenization."""
