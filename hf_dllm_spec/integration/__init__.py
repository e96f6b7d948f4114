"""transformers' side: the `custom_generate` callable every entry point runs (`generate`), the plan of one call
with all its checks (`plan`), where each row ends (`stopping`), rows that join a running call (`continuous`), the
model-class `generate` backend (`mixin`), the raw call's checks (`checks`), DEER as a transformers
`CandidateGenerator` (`candidate_generator`).
"""
