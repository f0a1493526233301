"""Sources of weights: Hugging Face directories, GGUF files and synth: presets, all read by canonical name."""
