"""tdz wing."""
