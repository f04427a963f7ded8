"""Files in and out: weights, outputs, model loading and cards, the data folder, YAML, tokenizer files."""
