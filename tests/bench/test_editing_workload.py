"""The editing workload (folio/bench/editing.py): standard-library code within the token
budget, a rename instruction naming a defined name, distinct prompts past a lap."""
from __future__ import annotations

from folio.bench.editing import editing_prompts, stdlib_sources


def test_editing_prompts_hold_code_within_the_budget(smollm2_tokenizer) -> None:
    paths = stdlib_sources()
    assert len(paths) > 50
    prompts = editing_prompts(smollm2_tokenizer, 3, 120)
    for text in prompts:
        head, code = text.split("```python\n", 1)
        code = code.split("```\n\nRewritten code:", 1)[0]
        assert 20 < len(smollm2_tokenizer.encode(code, add_special_tokens=False)) <= 120
        old = head.split("`")[1]
        assert old in code and text.endswith("```python\n")
    # a lap later: the same files, other lines
    again = editing_prompts(smollm2_tokenizer, 3, 120, start=len(paths))
    assert all(a != b for a, b in zip(prompts, again))
    assert len(set(editing_prompts(smollm2_tokenizer, 8, 60))) == 8
