"""GGML quantized types: their table (types.py), plain-torch dequantizers (dequant.py), quantizers (quantize.py) and
llama-quantize's type mixes (mix.py). Expert weights stay in these blocks from the file to the slot to the kernel."""
