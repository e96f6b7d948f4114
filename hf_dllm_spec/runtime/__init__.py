"""Running forwards: the eager `ModelRunner` over a growing cache, the static runtime beside it,
timing, the per-forward trace, a model's weights (placement, quantization, the check that they can decode).
"""
