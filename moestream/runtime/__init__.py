"""The runtime: KV cache, the engine (load, place, forward in ubatches), generation, sampling."""
