"""NEO's CPU side: the binding of the paged decode-attention library in `kernels/` (its build, ABI, input checks,
operations and the pipeline's hand-off flags) and the CPUs it runs on."""
