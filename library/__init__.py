"""Shared library of the training toolkit: args, model families, data, training loop, sampling."""
