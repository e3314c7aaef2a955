"""The executor: the model runner and what it drives (the NEO pipeline, CUDA graphs, the host KV pool and the swapper, SM partitions, start-up profiling)."""
