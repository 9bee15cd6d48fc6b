"""The first step of an engine whose FP8 KV cache computes its scales (calculate_kv_scales).

The worker takes each layer's K and V scales from the largest |K| and |V| of the first step it
runs (vLLM's rule), with a fixed headroom under e4m3's 448 for later steps' larger values.
When that first step is a user's one-token prompt, its keys and values are far smaller than a
longer text's: on SmolLM2, "Hi" alone gave scales 6x (K) and 13x (V) too small, later values
saturated, and the perplexity of an English text rose 6.5 % over a float cache (0.3-0.9 % when
the first step is a sentence). So the engine runs this fixed text first, at start-up: a few
kinds of text (prose, a list, code, numbers), so that the scales do not depend on who asks
first. More headroom instead would cost precision: a few outlier channels set a layer's
largest value, and the rest then fall into e4m3's coarse subnormal range.
"""
from __future__ import annotations

from typing import Any

# Written for this purpose (mixed registers; about 160 tokens with a BPE tokenizer).
CALIBRATION_TEXT = (
    "The library opens at nine on weekdays and at ten on Saturdays. Visitors may borrow up "
    "to six books for three weeks; journals stay in the reading room.\n"
    "Shopping list: 2 kg of potatoes, a dozen eggs, olive oil, 500 g of flour, and coffee.\n"
    "def mean(values):\n    total = sum(values)\n    return total / len(values)\n\n"
    "Q: What is 17 multiplied by 23?\nA: 17 x 23 = 391.\n"
    "In 1969 the first crewed landing on the Moon took place; the mission lasted eight days, "
    "three hours and eighteen minutes. Die Sonne scheint heute, et il fait beau.\n"
)


def calibration_token_ids(tokenizer: Any) -> list[int]:
    """The calibration text as the model's tokens (with the tokenizer's special prefix)."""
    return list(tokenizer(CALIBRATION_TEXT)["input_ids"])
