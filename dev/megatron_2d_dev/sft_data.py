"""A tiny SFT corpus for Megatron's ``--sft`` route, made offline: a Hugging Face tokenizer directory and a jsonl of
packed conversations, as Megatron's SFTTokenizer (``--tokenizer-type SFTTokenizer``) and SFTDataset read them.

    tokenizer_dir = write_sft_tokenizer(tmp / "tokenizer")      # AutoTokenizer.from_pretrained(tokenizer_dir) loads it
    data = write_sft_conversations(tmp / "sft.jsonl")           # {"messages": [...]} per line

The tokenizer is a word-level one (``tokenizers`` WordLevel, whitespace split) over the words the conversations use,
saved with ``save_pretrained``, with the special tokens of Megatron's default SFT prompt format
(``--sft-tokenizer-prompt-format nemotron-h-aligned``): ``<SPECIAL_10>`` opens a system turn, ``<SPECIAL_11>`` a user
turn and the assistant prefix, ``<SPECIAL_233>`` pads. Every word is one token, so a turn's length is known from its
text: that format renders a system turn as 2 + its words, a user turn as 4 + its words (``<SPECIAL_11> User ...
<SPECIAL_11> Assistant``), an assistant turn as its words (only assistant tokens carry loss).
"""

from __future__ import annotations

import json
import os
import pathlib
import random

PROMPT_FORMAT = "nemotron-h-aligned"
SPECIAL_TOKENS = {
    "unk": "<unk>",
    "eos": "<eos>",
    "pad": "<SPECIAL_233>",
    "system": "<SPECIAL_10>",
    "turn": "<SPECIAL_11>",
}
WORDS = [f"w{i}" for i in range(40)]
ROLE_WORDS = ["System", "User", "Assistant"]


def write_sft_tokenizer(directory: os.PathLike) -> pathlib.Path:
    """A word-level tokenizer over :data:`WORDS` with the prompt format's special tokens, saved to ``directory``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS.values(), *ROLE_WORDS, *WORDS])}
    words = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS["unk"]))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words,
        unk_token=SPECIAL_TOKENS["unk"],
        eos_token=SPECIAL_TOKENS["eos"],
        pad_token=SPECIAL_TOKENS["pad"],
        additional_special_tokens=[SPECIAL_TOKENS["system"], SPECIAL_TOKENS["turn"]],
    )
    directory = pathlib.Path(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def conversation(rng: random.Random, turn_words: list[int]) -> list[dict[str, str]]:
    """A system message, then user / assistant turns with ``turn_words`` words each (user, assistant, user, ...)."""
    messages = [{"role": "system", "content": _text(rng, 2)}]
    for turn, words in enumerate(turn_words):
        messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": _text(rng, words)})
    return messages


def conversation_tokens(messages: list[dict[str, str]]) -> int:
    """Tokens the prompt format renders ``messages`` (one conversation) into (see the module docstring)."""
    extra = {"system": 2, "user": 4, "assistant": 0}
    return sum(extra[m["role"]] + len(m["content"].split()) for m in messages)


def write_sft_conversations(
    path: os.PathLike, lines: int = 12, seq_length: int = 128, pad_multiple: int = 8, seed: int = 0
) -> pathlib.Path:
    """``lines`` jsonl lines, each 2-4 conversations packed into one ``messages`` list (a new conversation starts at
    each system message), of 1-2 user / assistant rounds with turns of 1-9 words (one-token assistant turns
    included). A line fits in ``seq_length`` tokens even with each conversation padded to a multiple of
    ``pad_multiple`` (SFTDataset pads to 2 * CP), so no CP size truncates a conversation."""
    rng = random.Random(seed)
    path = pathlib.Path(path)
    with open(path, "w") as out:
        for _ in range(lines):
            messages: list[dict[str, str]] = []
            padded = 0
            for _ in range(rng.randint(2, 4)):
                candidate = conversation(rng, [rng.choice([1, 1, 2, 5, 9]) for _ in range(2 * rng.randint(1, 2))])
                length = -(-conversation_tokens(candidate) // pad_multiple) * pad_multiple
                if padded + length > seq_length:
                    break
                messages += candidate
                padded += length
            out.write(json.dumps({"messages": messages}) + "\n")
    return path
