"""`sluice train`: recipes, the corpus and tokenizer, the training loop, and the HF export."""
