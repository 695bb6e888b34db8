"""zipfmt.kernels wing."""
