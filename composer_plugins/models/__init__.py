"""Policy models: the embedded tiny default, tokenizer training, generation and log-prob utilities."""
