"""Hugging Face integrations, with Ray Train's module names: `unbroken.train.huggingface.transformers`.

Importing this package imports no Hugging Face library; its modules import theirs on use.
"""
