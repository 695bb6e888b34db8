"""archive wing."""
