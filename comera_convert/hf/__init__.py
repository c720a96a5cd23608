"""transformers integration: the "comera" quantization method that loads compressed checkpoints."""
