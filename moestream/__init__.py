"""moestream: run Mixture-of-Experts language models bigger than the GPU, at the speed of the PCIe link.

    from moestream import LLM
    llm = LLM("synth:tiny")
    print(llm.generate("Hello", max_tokens=8).text)
"""
from .api import LLM
from .errors import UserError
from .runtime.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "UserError"]
__version__ = "0.1.0"
