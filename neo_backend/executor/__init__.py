"""The executor: the model runner and what it drives (the NEO pipeline, CUDA graphs, the host KV pool and its
swapper, host attention, SM partitions, start-up profiling)."""
