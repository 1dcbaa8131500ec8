"""``quantization="int8"``: the dense layers multiply in int8 on CPU, their SmoothQuant factors calibrated once at
load on a few built-in texts (a mixture-of-experts router stays in float; the output layer too, unless
``int8_output_layer``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from roseinfer.models.linear import Linear

# Layers left in float: the routers (a flipped expert choice costs more than their tiny GEMMs save), and unless
# asked otherwise the output layer (the logits sampling reads: it costs a little more accuracy than another layer).
KEPT_IN_FLOAT = frozenset(("router", "shared_expert_gate"))
OUTPUT_LAYER = "lm_head"
# Texts of several kinds (prose, code, a list, a letter, a question), apart from the benchmark's prompts.
CALIBRATION_TEXTS = (
    "The printing press spread across Europe within fifty years of Gutenberg's first Bible, and with it came "
    "cheaper books, standard spellings and the pamphlets of the Reformation.",
    "def merge(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n"
    "            out.append(a[i]); i += 1\n        else:\n            out.append(b[j]); j += 1\n"
    "    return out + a[i:] + b[j:]",
    "Ingredients: 2 cups flour, 1 tsp salt, 3 eggs, 250 ml milk. Whisk, rest 30 minutes, fry thin in butter.",
    "Dear Ms. Alvarez, thank you for your letter of 4 March. We have corrected the invoice (No. 1187) and "
    "enclosed a refund of $42.50.",
    "Why do the planets orbit the Sun in nearly the same plane, and what does that tell us about how they formed?",
    "Translate into German: the train to Munich leaves at half past nine from platform four.",
)
ALPHA = 0.5  # SmoothQuant's migration strength: half of each input channel's range moves into the weight


def dense_layers(model: Any, with_output_layer: bool = False) -> list[Linear]:
    """Every ``Linear`` of ``model`` but those ``KEPT_IN_FLOAT`` (and its output layer, unless
    ``with_output_layer``), each once, in the order the model holds them."""
    kept = KEPT_IN_FLOAT if with_output_layer else KEPT_IN_FLOAT | {OUTPUT_LAYER}
    found: list[Linear] = []
    seen: set[int] = set()

    def walk(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, Linear):
            found.append(obj)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item)
        elif type(obj).__module__.startswith("roseinfer.models"):
            for name, value in vars(obj).items():
                if name not in kept:
                    walk(value)

    walk(model)
    return found


@contextlib.contextmanager
def input_maxima(layers: list[Linear]) -> Iterator[dict[int, torch.Tensor]]:
    """Each layer's largest input magnitude per channel over the calls made inside the block, by ``id(layer)``."""
    maxima: dict[int, torch.Tensor] = {}
    watched = {id(layer) for layer in layers}
    original = Linear.__call__

    def observed(layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if id(layer) in watched:
            seen = x.detach().float().abs().reshape(-1, x.shape[-1]).amax(dim=0)
            before = maxima.get(id(layer))
            maxima[id(layer)] = seen if before is None else torch.maximum(before, seen)
        return original(layer, x)

    Linear.__call__ = observed  # (the calibration's requests only: the engine serves none yet)
    try:
        yield maxima
    finally:
        Linear.__call__ = original


def calibration_prompts(engine: Any) -> list[list[int]]:
    """The calibration texts as the engine's model reads them: chat turns where it has a chat template, plain text
    where it has a tokenizer only, and ids spread over the vocabulary where it has none (a test's random model)."""
    tok = engine.tokenizer
    if tok is None:
        gen = torch.Generator().manual_seed(0)
        return [torch.randint(0, engine.model.vocab_size, (48,), generator=gen).tolist() for _ in CALIBRATION_TEXTS]
    if getattr(tok, "chat_template", None):
        try:
            return [engine.tokenize({"messages": [{"role": "user", "content": t}]})[1] for t in CALIBRATION_TEXTS]
        except Exception:  # a template that wants more than one user turn (a system prompt, say): the plain text
            pass
    return [tok.encode(text) for text in CALIBRATION_TEXTS]


def quantize(layers: list[Linear], maxima: dict[int, torch.Tensor]) -> None:
    """Each layer to int8, smoothed by its calibrated input maxima (none seen: plain per-token scales)."""
    for layer in layers:
        layer.quantize_int8(maxima.get(id(layer)), ALPHA)
