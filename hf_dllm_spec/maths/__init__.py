"""The step rules of the strategies as pure tensor functions: attention patterns, which positions a
denoising step commits, sampling, S2D2 routing, speculative acceptance, token editing. No model, no
cache, no config object beyond the small parameter dataclasses.
"""
