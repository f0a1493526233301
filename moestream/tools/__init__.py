"""Command-line tools: make-model (and later bench, perplexity)."""
