"""Host-side software of the Gemma 3n NPU: sampling, tokenizer and the generation driver."""
