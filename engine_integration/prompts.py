"""Prompt files for ``kvxfer generate``: JSON lines of token ids.

Apart from ``launch`` so that the CLI can check a prompt file without importing torch and the engines.
"""

from __future__ import annotations

import json


def read_prompts(path: str) -> list[list[int]]:
    """JSON lines, each a list of token ids (blank lines skipped)."""
    prompts = []
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            value = json.loads(line)
            if not (isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)):
                raise ValueError(f"{path}:{n}: expected a JSON list of token ids, got {line.strip()[:60]!r}")
            prompts.append(value)
    return prompts
