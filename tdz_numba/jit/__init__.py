"""jit wing."""
