"""remote wing."""
