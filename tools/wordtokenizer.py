"""An offline tokenizer for the demo model's directory: SGLang's text path and its benchmark client need one,
and no hub is reachable.

A `tokenizers` WordLevel model, saved as a Hugging Face tokenizer directory (tokenizer.json and a
tokenizer_config.json with a chat template) next to the model's config.json. Its rules:
- Vocabulary words hold letters only. SGLang's client builds random prompts by decoding random token ids
  and counts them by encoding the text again, so every vocabulary entry must come back as itself; a word
  with digits would be split by the digits rule below into several tokens.
- Numbers are split into single digits, which are in the vocabulary. The `mooncake` dataset glues each
  hash id to a word ("708hi"); without this rule every such block would be the one unknown token, and
  prompts of the same length would be the same prompt.
- The words of the client's fixed texts ("hi", "story", "Tell me a story based on this context.") and of
  the chat template are in the vocabulary, so those texts carry no unknown tokens.
"""

from __future__ import annotations

import json
import os
import random

SPECIAL = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0-3: the demo config's bos 1 and eos 2
DIGITS = tuple("0123456789")
PUNCTUATION = tuple(".,:;?!'\"()-")
FIXED_WORDS = ("hi", "story", "Round", "Tell", "me", "a", "based", "on", "this", "context", "user", "assistant",
               "system")
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
_ONSETS = ("b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z", "ch", "sh", "th",
           "st", "tr", "pl")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")


def letter_words(n: int, seed: int = 7, taken: frozenset = frozenset()) -> list[str]:
    """`n` distinct pronounceable words of 2-3 syllables, letters only, reproducible from `seed`."""
    rng = random.Random(seed)
    out, seen = [], set(taken)
    while len(out) < n:
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.randint(2, 3)))
        if word not in seen:
            seen.add(word)
            out.append(word)
    return out


def vocabulary(size: int) -> dict[str, int]:
    """Token -> id: the special tokens, digits, punctuation and fixed words, then letter words up to `size`."""
    head = [*SPECIAL, *DIGITS, *PUNCTUATION, *FIXED_WORDS]
    if size <= len(head):
        raise ValueError(f"a vocabulary of {size} cannot hold the {len(head)} fixed entries")
    return {w: i for i, w in enumerate(head + letter_words(size - len(head), taken=frozenset(head)))}


def build(size: int):
    """The `tokenizers.Tokenizer`: WordLevel over `vocabulary(size)`, whitespace and punctuation split, digits
    one by one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocabulary(size), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    tok.add_special_tokens(list(SPECIAL))
    return tok


def write(model_dir: str, size: int) -> str:
    """Save the tokenizer into `model_dir` (beside its config.json); `size` is at most the model's vocab."""
    build(size).save(os.path.join(model_dir, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": 32768, "add_bos_token": False,
              "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return model_dir
