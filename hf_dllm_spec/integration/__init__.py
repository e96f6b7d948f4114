"""transformers' side: the `custom_generate` callable every entry point runs (`generate`), the plan of one call
with all its checks (`plan`), the rows of a running call (`rows`: where each ends, and those that join it), the
model-class `generate` backend (`mixin`), the raw call's checks (`checks`), DEER as a transformers
`CandidateGenerator` (`candidate_generator`).
"""
