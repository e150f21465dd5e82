"""The prompts of a /v1/completions body: one prompt (text or token ids), or a batch of them (a
list of texts or of token-id lists), each its own choices, as OpenAI and vLLM answer it.

A refusal names the prompt: ``prompt`` for a single one, ``prompt[i]`` for one of a batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.adapter_store.errors import InvalidRequestError
from loraplex.inference_server.edge import checks as edge
from loraplex.inference_server.edge.checks import RequestLimits
from loraplex.inference_server.engine.api import PromptTokenizer


@dataclass(frozen=True, slots=True)
class CompletionPrompt:
    """One prompt of a completions request: its token ids, its text as sent (None for token ids:
    ``echo`` decodes them) and the parameter a refusal of it names."""

    ids: tuple[int, ...]
    text: str | None
    field: str


def _batch(prompt: str | list) -> list[str | list[int]]:
    """The prompts ``prompt`` holds: a list of texts or of token-id lists is a batch; a text or
    one list of token ids is one prompt."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


def completion_prompts(prompt: str | list, tokenizer: PromptTokenizer, limits: RequestLimits,
                       max_prompts: int) -> list[CompletionPrompt]:
    """Every prompt of ``prompt``, checked and tokenized; a batch of more than ``max_prompts``
    prompts is refused (400 naming ``prompt``)."""
    batch = _batch(prompt)
    if len(batch) > max_prompts:
        raise InvalidRequestError(f"{len(batch)} prompts; this server takes at most {max_prompts} in one request "
                                  "(--max-batch-prompts)", "prompt")
    return [_one(p, tokenizer, limits, "prompt" if len(batch) == 1 else f"prompt[{i}]") for i, p in enumerate(batch)]


def _one(prompt: str | list[int], tokenizer: PromptTokenizer, limits: RequestLimits, field: str) -> CompletionPrompt:
    if isinstance(prompt, str):
        edge.check_text_length(prompt, limits, field)
        ids = tuple(tokenizer.encode(prompt)) if prompt else ()
        return CompletionPrompt(edge.check_prompt_ids(ids, limits, field), prompt, field)
    if any(t < 0 for t in prompt):
        raise InvalidRequestError("token ids must be >= 0", field)
    ids = edge.check_token_ids(prompt, limits.vocab_size, field)
    return CompletionPrompt(edge.check_prompt_ids(ids, limits, field), None, field)
