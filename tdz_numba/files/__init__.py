"""files wing."""
