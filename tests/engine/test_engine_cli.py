"""``kvxfer generate``: the command's parser and output, with a real disaggregated cluster."""

from __future__ import annotations

import json

from engine_integration.launch import generate_colocated
from kvxfer.cli import main

from engine_helpers import varied_prompts


def test_generate_disagg_prints_one_line_per_prompt_and_fails_loudly(tmp_path, capsys):
    prompts = varied_prompts(5, seed=1)
    bad = [1, 2, 300]  # token id outside the vocabulary
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in [*prompts, bad]))
    rc = main(["generate", "--prompts", str(path), "--max-new-tokens", "4", "--disagg", "--backend", "local"])
    out = capsys.readouterr()
    lines = [json.loads(line) for line in out.out.splitlines()]
    assert rc == 1, out.err
    assert lines[:-1] == [list(r.tokens) for r in generate_colocated(prompts, 4)]
    assert "error" in lines[-1] and "[0, 256)" in lines[-1]["error"]
    assert "1 of 6 requests failed" in out.err


def test_generate_colocated_reads_json_lines(tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text("[5, 6, 7, 8, 9]\n\n[1]\n")
    assert main(["generate", "--prompts", str(path), "--max-new-tokens", "3"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines == [list(r.tokens) for r in generate_colocated([[5, 6, 7, 8, 9], [1]], 3)]
