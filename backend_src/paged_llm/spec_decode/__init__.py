"""Speculative decoding (issue "Speculative decoding"): proposers and the verification rule."""
