"""Small kernels outside the GEMM: finishing steps of reductions."""
