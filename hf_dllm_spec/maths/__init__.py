"""The step rules of the strategies as pure tensor functions: attention patterns, which positions a
denoising step commits, sampling, S2D2 routing, speculative acceptance, token editing. No model, no
cache; pure functions, beside the small parameter dataclasses (`EditingConfig`) and the `Sampler`, which keeps the
batch's per-row generators and processors.
"""
