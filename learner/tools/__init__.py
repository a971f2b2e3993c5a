"""Learner tools run outside a training run: the exported policy and the tiny model's warm start."""
