"""Reference models that use graphsafe the way a user would."""
