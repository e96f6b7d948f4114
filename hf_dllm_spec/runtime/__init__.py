"""Running forwards: the eager `ModelRunner` over a growing cache, the static runtime beside it,
timing, the per-forward trace, device placement and quantization checks.
"""
