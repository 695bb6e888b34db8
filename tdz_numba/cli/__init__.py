"""cli wing."""
