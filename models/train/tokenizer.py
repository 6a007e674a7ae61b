"""The byte-level BPE tokenizer of the trained small models, with a chat template.

Special tokens take ids 0..4: ``<|bos|>`` 0, ``<|eos|>`` 1, ``<|user|>`` 2,
``<|assistant|>`` 3, ``<|system|>`` 4; then the 256 byte symbols, then the
merges learned from the corpus (``tokenizers`` BPE, GPT-2 pre-tokenization).
Encoding text adds ``<|bos|>``. The chat template renders
``<|bos|>`` then per message ``<|ROLE|>content`` (an assistant message ends
with ``<|eos|>``), then ``<|assistant|>`` when a reply is wanted; the corpus
renders its chat documents with the same template, so the model learns to
close its replies with ``<|eos|>``.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["SPECIAL_TOKENS", "BOS_ID", "EOS_ID", "CHAT_TEMPLATE", "train_tokenizer", "render_chat"]

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>")
BOS_ID, EOS_ID = 0, 1
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """``CHAT_TEMPLATE`` rendered without a tokenizer (the corpus encoder and tests use it).

    Equal to ``tokenizer.apply_chat_template(messages, tokenize=False, ...)``.
    """
    out = [SPECIAL_TOKENS[BOS_ID]]
    for m in messages:
        out.append(f"<|{m['role']}|>{m['content']}")
        if m["role"] == "assistant":
            out.append(SPECIAL_TOKENS[EOS_ID])
    if add_generation_prompt:
        out.append("<|assistant|>")
    return "".join(out)


def train_tokenizer(texts: Iterable[str], vocab_size: int, model_max_length: int):
    """Train the module docstring's tokenizer on ``texts``; a ``PreTrainedTokenizerFast``.

    Deterministic for the same texts in the same order (``tokenizers`` BPE
    breaks frequency ties by the pair's symbols).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be at least {len(SPECIAL_TOKENS) + 256} (specials + bytes), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos = SPECIAL_TOKENS[BOS_ID]
    if tok.token_to_id(bos) != BOS_ID or tok.token_to_id(SPECIAL_TOKENS[EOS_ID]) != EOS_ID:
        raise RuntimeError("BPE trainer did not place the special tokens first")
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, BOS_ID)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=SPECIAL_TOKENS[EOS_ID],
        additional_special_tokens=list(SPECIAL_TOKENS[2:]),
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )
