"""Hugging Face integrations, with Ray Train's module names: `unbroken.train.huggingface.transformers`.

Importing this package imports no Hugging Face library; its modules import theirs on use.
"""

from __future__ import annotations

from typing import Any

from unbroken.core import ray_names as _ray_names


def __getattr__(name: str) -> Any:
    _ray_names.refuse(__name__, name)  # a Ray name unbroken does not provide: says what instead
