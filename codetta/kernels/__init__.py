"""Small memory-bound kernels around the GEMMs: finishing steps of reductions, RoPE and SwiGLU backward."""
