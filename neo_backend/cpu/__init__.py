"""NEO's CPU side: compiling the paged decode-attention library in `kernels/`, and the CPUs it runs on."""
