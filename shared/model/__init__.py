"""The model: its configuration, weights loaders (GGUF, HF, seeded dummy) and tokenizer."""
