"""moestream: run Mixture-of-Experts language models bigger than the GPU, at the speed of the PCIe link.

    from moestream import LLM
    llm = LLM("synth:tiny")
    print(llm.generate("Hello", max_tokens=8).text)

LLM and SamplingParams are imported on first use (PEP 562), so `import moestream` and `moestream --help` do
not import torch.
"""
from .errors import UserError

__all__ = ["LLM", "SamplingParams", "UserError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from .api import LLM
        return LLM
    if name == "SamplingParams":
        from .runtime.sampling import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'moestream' has no attribute {name!r}")
