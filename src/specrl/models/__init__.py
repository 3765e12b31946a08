"""Models: the target decoder family, the EAGLE-3 draft, checkpoint I/O, presets, tokenizer."""
