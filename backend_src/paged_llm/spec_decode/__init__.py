"""Speculative decoding: the proposers (n-gram, draft model) and when to speculate. Verifying the
proposals is sampling's (sampling/verify.py, sampling/rejection.py)."""
