"""Checkpoints for the Hub: `export_checkpoint` and the `custom_generate/` folder it copies (data, not a
module of this package).
"""
