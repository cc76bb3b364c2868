"""Experiments that test claims about attention heads with multihead's own layer."""
