"""Data: sources and chat converters, tokenization with assistant loss masks, packing,
segment masks and the grain input pipeline (``make_dataset``)."""

from selforch_jax.data.masks import segment_mask
from selforch_jax.data.packing import pack_dataset, pad_dataset, pad_example
from selforch_jax.data.pipeline import DataConfig, make_dataset, split_examples
from selforch_jax.data.sources import (DATA_DIR, DATASETS, ListSource, alpaca_eval_to_messages,
                                       alpaca_to_messages, chat_to_messages, data_dir,
                                       gsm8k_final_answer, gsm8k_to_messages, heldout_split,
                                       load_examples, read_json, read_jsonl, resolve_path)
from selforch_jax.data.tokenize import ChatTokenizer, shift_for_lm, tokenize_chat, tokenize_example

__all__ = [
    "ChatTokenizer", "DATA_DIR", "DATASETS", "DataConfig", "ListSource",
    "alpaca_eval_to_messages", "alpaca_to_messages", "chat_to_messages", "data_dir",
    "gsm8k_final_answer", "gsm8k_to_messages", "heldout_split", "load_examples",
    "make_dataset", "pack_dataset", "pad_dataset", "pad_example", "read_json", "read_jsonl",
    "resolve_path", "segment_mask", "shift_for_lm", "split_examples", "tokenize_chat",
    "tokenize_example",
]
