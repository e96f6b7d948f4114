"""transformers' side: the `custom_generate` callable every entry point runs, the model-class
`generate`, input checks, streamers, DEER as a transformers `CandidateGenerator`.
"""
