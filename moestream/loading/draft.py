"""A target model with an MTP head read from another file (--model-draft FILE, llama.cpp's spelling): one
WeightSource whose trunk is the target's and whose head layer (blk.{n_layers}, nextn.*, its experts) is the file's.

    src = with_head(open_source("model.gguf"), "model-mtp.gguf")
    src.config.nextn_layers                 # the file's head (it replaces one the target ships)

The head file is a GGUF as llama.cpp b11549 loads one beside its target (common/speculative.cpp: a model whose
trunk layers are absent, llama-model.cpp `nextn_flags`): the target's metadata (block_count n_layers + heads,
nextn_predict_layers), the head's block and nextn.* tensors, and its own token_embd and output, which the head uses
where they differ from the target's (runtime/load.py `head_io`). A file without them (no b11549 key names one; the
issue's `nextn_shared_target_tensors` is not in b11549) borrows the target's. The head's experts join the target's
in one host store and cache, as an embedded head's do.
"""
from __future__ import annotations


from ..arch.names import optional_names
from ..errors import UserError


class WithHead:
    """`target`'s weights, its head layers' from `head` (a GGUFSource opened against the target's config)."""

    def __init__(self, target, head):
        self.target, self.head = target, head
        self.config = head.config
        self.tokenizer = target.tokenizer
        self._prefixes = tuple(f"blk.{i}." for i in self.config.head_layers)
        # the head's own embedding and output head: its nextn.* where the file has them, else its token_embd and
        # output (llama.cpp's MTP-only files carry them; a tied output is token_embd), else none: the target's
        own = {}
        for name in optional_names(self.config):
            fallback = ("token_embd.weight",) if name.endswith("embed_tokens.weight") else \
                ("output.weight", "token_embd.weight")
            own[name] = next((n for n in (name, *fallback) if head.has(n)), None)
        self._own = own

    def _of(self, name: str):
        return self.head if name.startswith(self._prefixes) else self.target

    def has(self, name: str) -> bool:
        if name in self._own:
            return self._own[name] is not None
        return self._of(name).has(name)

    def tensor(self, name: str) -> torch.Tensor:
        if self._own.get(name):
            return self.head.tensor(self._own[name])
        return self._of(name).tensor(name)

    def dtype_of(self, name: str):
        return self._of(name).dtype_of(name)

    def rows(self, name: str):
        return self.target.rows(name)

    def expert(self, layer: int, e: int):
        return (self.head if layer in self.config.head_layers else self.target).expert(layer, e)

    def expert_types(self, layer: int):
        return (self.head if layer in self.config.head_layers else self.target).expert_types(layer)

    def expert_bytes(self, layer: int, e: int):
        return (self.head if layer in self.config.head_layers else self.target).expert_bytes(layer, e)

    def __getattr__(self, name: str):
        """Anything else a loader asks (a GGUF's type counts, its path): the target's."""
        return getattr(self.target, name)


def with_head(target, path: str, spec):
    """`target` with the MTP head of the GGUF at `path`; spec: the engine's SpecConfig (it must run the head)."""
    from .gguf import GGUFSource
    if not spec.mtp:
        raise UserError("--model-draft is an MTP head's GGUF: add --spec-type draft-mtp, or drop --model-draft")
    if not str(path).endswith(".gguf"):
        raise UserError(f"--model-draft {path!r}: give the MTP head's .gguf file (llama.cpp's MTP-only layout)")
    return WithHead(target, GGUFSource(path, target=target.config))
