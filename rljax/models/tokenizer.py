"""Tokenizer helpers: HF tokenizers from local folders, a local character tokenizer,
chat templates and prompt encoding. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import pathlib
import string
from collections.abc import Sequence

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
# AutoTokenizer is imported where it is used: importing it imports torch when torch is
# installed (~1.2 s a process here), which only loading a tokenizer folder needs.
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from rljax.models.config import ModelConfig

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
DEFAULT_ALPHABET = string.ascii_letters + string.digits + string.punctuation + " \n"
# One line per message, "role: content", each opened by <bos> and closed by <eos>.
CHAR_CHAT_TEMPLATE = (
    "{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<bos>assistant: {% endif %}"
)


# Where a tokenizer keeps the extra stop ids: in `init_kwargs`, so `save_pretrained`
# writes them to tokenizer_config.json and a saved run's tokenizer folder keeps them.
GENERATION_EOS_KEY = "generation_eos_token_ids"


def generation_eos_ids(folder: str | os.PathLike) -> tuple[int, ...]:
    """`eos_token_id` of `folder/generation_config.json` (an int or a list; Llama-3-Instruct
    lists `<|end_of_text|>` and `<|eot_id|>`), or () without that file or field."""
    path = pathlib.Path(folder) / "generation_config.json"
    if not path.is_file():
        return ()
    ids = json.loads(path.read_text()).get("eos_token_id")
    ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{path}: eos_token_id={ids!r}; allowed: a token id or a list of them")
    return tuple(ids)


def add_stop_ids(tokenizer, ids) -> None:
    """Record `ids` as further ids that end a completion (see `stop_token_ids`)."""
    have = list(tokenizer.init_kwargs.get(GENERATION_EOS_KEY) or [])
    tokenizer.init_kwargs[GENERATION_EOS_KEY] = have + [int(i) for i in ids if i not in have]


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """Every id that ends a completion, resolved once: the tokenizer's `eos_token_id`
    first, then the ids recorded by `add_stop_ids` (`load_tokenizer` records
    generation_config.json's `eos_token_id` list), without repeats. A tokenizer without
    EOS: ValueError."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError("tokenizer has no eos_token_id; the trainer needs one to end completions")
    extra = (getattr(tokenizer, "init_kwargs", None) or {}).get(GENERATION_EOS_KEY) or ()
    return tuple(dict.fromkeys([int(eos), *(int(i) for i in extra)]))


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """`transformers.AutoTokenizer` from a local folder (never the Hub). The folder's
    generation_config.json `eos_token_id` ids, if any, become stop ids
    (`stop_token_ids`)."""
    path = pathlib.Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"load_tokenizer: {path} is not a directory")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    add_stop_ids(tok, generation_eos_ids(path))
    return tok


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET, path: str | os.PathLike | None = None,
                         ) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: ids 0-3 are <pad> <bos> <eos> <unk>, then one id per
    character of `alphabet` in order. Has a simple chat template (`CHAR_CHAT_TEMPLATE`).

    Built with the `tokenizers` library (WordLevel over single characters) and wrapped as
    a `PreTrainedTokenizerFast`; with `path`, it is also saved there (loadable with
    `load_tokenizer` / `AutoTokenizer`).
    """
    if not isinstance(alphabet, str) or not alphabet:
        raise ValueError(f"build_char_tokenizer: alphabet must be a non-empty str, got {alphabet!r}")
    if len(set(alphabet)) != len(alphabet):
        raise ValueError("build_char_tokenizer: alphabet has repeated characters")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        unk_token="<unk>", padding_side="left",
    )
    fast.chat_template = CHAR_CHAT_TEMPLATE
    if path is not None:
        fast.save_pretrained(str(path))
    return fast


def apply_chat_template(tokenizer: PreTrainedTokenizerBase,
                        messages_list: Sequence[Sequence[dict[str, str]]], *,
                        add_generation_prompt: bool = True) -> list[str]:
    """Render each conversation (a list of {"role", "content"} dicts) to prompt text."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("apply_chat_template: the tokenizer has no chat_template")
    out = []
    for i, messages in enumerate(messages_list):
        if not isinstance(messages, Sequence) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise ValueError(
                f"apply_chat_template: conversation {i} must be a list of dicts with "
                "'role' and 'content'"
            )
        out.append(tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt))
    return out


def encode_prompts(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], *,
                   max_len: int | None = None, truncate: str = "error") -> list[list[int]]:
    """Token ids of each text (special tokens only where the text spells them out).

    max_len: longest allowed prompt. truncate="error" raises for a longer prompt (naming
    it); "left" keeps its last `max_len` tokens (the end holds the generation prompt).
    """
    if truncate not in ("error", "left"):
        raise ValueError(f"encode_prompts: truncate={truncate!r}; allowed: 'error', 'left'")
    if max_len is not None and (not isinstance(max_len, int) or max_len <= 0):
        raise ValueError(f"encode_prompts: max_len must be a positive int, got {max_len!r}")
    if isinstance(texts, str):
        raise TypeError("encode_prompts: texts must be a list of str, got one str")
    out = []
    for i, text in enumerate(texts):
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if max_len is not None and len(ids) > max_len:
            if truncate == "error":
                raise ValueError(
                    f"encode_prompts: prompt {i} has {len(ids)} tokens, more than "
                    f"max_len={max_len}; shorten it or pass truncate='left'"
                )
            ids = ids[-max_len:]
        out.append(ids)
    return out


def check_vocab(tokenizer: PreTrainedTokenizerBase, config: ModelConfig) -> None:
    """Raise if the tokenizer can produce ids outside the model's embedding table."""
    n = len(tokenizer)
    if n > config.vocab_size:
        raise ValueError(
            f"tokenizer has {n} tokens but the model's vocab_size is {config.vocab_size}; "
            f"the model needs vocab_size >= {n}"
        )


def check_same_tokenizer(student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase,
                         where: str = "teacher") -> None:
    """Raise unless ``teacher`` maps text to the same ids as ``student``: the same
    vocabulary (token -> id) and the same pad / bos / eos / unk ids.

    On-policy distillation scores the student's sampled token ids with the teacher, so an
    id must mean the same token to both (Agarwal et al. 2024 and Thinking Machines 2025
    distil within one tokenizer family). ``where`` names the teacher in the error.
    """
    sv, tv = student.get_vocab(), teacher.get_vocab()
    if sv != tv:
        diff = sorted(set(sv.items()) ^ set(tv.items()), key=lambda kv: (kv[1], kv[0]))
        example = ", ".join(f"{tok!r}->{i}" for tok, i in diff[:4])
        raise ValueError(
            f"{where}: its tokenizer differs from the student's ({len(tv)} vs {len(sv)} "
            f"tokens; {len(diff)} (token, id) pairs not shared, e.g. {example}). On-policy "
            "distillation needs a teacher with the student's tokenizer (same token -> id map)")
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "unk_token_id"):
        s, t = getattr(student, name, None), getattr(teacher, name, None)
        if s != t:
            raise ValueError(f"{where}: {name} is {t} but the student's is {s}; on-policy "
                             "distillation needs the student's tokenizer, special tokens included")
