"""zipfmt wing."""
