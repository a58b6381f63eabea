"""``kvxfer generate``: the command a user runs, end to end in subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys

from engine_integration.launch import generate_colocated

from engine_helpers import varied_prompts


def test_generate_disagg_prints_one_line_per_prompt_and_fails_loudly(tmp_path):
    prompts = varied_prompts(5, seed=1)
    bad = [1, 2, 300]  # token id outside the vocabulary
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in [*prompts, bad]))
    out = subprocess.run([sys.executable, "-m", "kvxfer.cli", "generate", "--prompts", str(path),
                          "--max-new-tokens", "4", "--disagg", "--backend", "local"],
                         capture_output=True, text=True, timeout=120)
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert out.returncode == 1, out.stderr
    assert lines[:-1] == [list(r.tokens) for r in generate_colocated(prompts, 4)]
    assert "error" in lines[-1] and "[0, 256)" in lines[-1]["error"]
    assert "1 of 6 requests failed" in out.stderr
