"""Declaring derivations: the specs, the registry and the class decorators."""
