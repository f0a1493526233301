"""The command line's parser: argparse without the two ways it misreads what llama.cpp users type.

    p = Parser(prog="moestream generate"); p.add_argument("-n", type=int); p.add_argument("-c", type=int)
    p.parse_args(["-ngl", "99"])     # UsageError: unknown flag -ngl (argparse alone reads it as -n gl)
    p.parse_args(["--ctx", "5"])     # UsageError: unknown flag --ctx; did you mean -c? (no prefix abbreviations)

argparse splits a single-dash token into short flags (`-ngl 99` is `-n gl`, `-co` is `-c o`, a bare `-fa` is
`-f a`, which reads a file named `a` as the prompt) and takes any unambiguous prefix of a long flag (`--ctx` for
`--ctx-size`). Here a token is a flag only as it is spelled in the table of its command, and anything else that
looks like a flag is refused, in one line, with the nearest flag. Light on purpose: no torch.
"""
from __future__ import annotations

import argparse
import difflib
import re

from .errors import UserError

# llama.cpp flags with no counterpart here, and what moestream does instead (the flags it does take are in
# compat.py). A habit that has a meaning is accepted; one that has none is refused with the way out.
NO_COUNTERPART = {
    "-co": "moestream prints plain text (no colours)", "--color": "moestream prints plain text (no colours)",
    "-i": "generate runs one prompt and exits; for a conversation use moestream serve and a chat client",
    "--interactive": "generate runs one prompt and exits; for a conversation use moestream serve and a chat client",
    "-if": "generate runs one prompt and exits; for a conversation use moestream serve and a chat client",
    "--mmproj": "moestream runs text models only",
    "-hf": "moestream reads local files only: download the model first, then -m PATH",
    "-hfr": "moestream reads local files only: download the model first, then -m PATH",
    "-mu": "moestream reads local files only: download the model first, then -m PATH",
    "--model-url": "moestream reads local files only: download the model first, then -m PATH",
    "-ctk": "the KV cache is kept in the model's dtype (--dtype)", "-ctv": "the KV cache is kept in the model's dtype (--dtype)",
    "--cache-type-k": "the KV cache is kept in the model's dtype (--dtype)",
    "--cache-type-v": "the KV cache is kept in the model's dtype (--dtype)",
    "-kvu": "each sequence (-np) has its own KV cache; leave it out",
    "--kv-unified": "each sequence (-np) has its own KV cache; leave it out",
    **dict.fromkeys(("--dry-multiplier", "--dry-base", "--dry-allowed-length", "--dry-penalty-last-n",
                     "--dry-sequence-breaker", "--xtc-probability", "--xtc-threshold", "--mirostat", "--mirostat-lr",
                     "--mirostat-ent", "--typical", "--top-nsigma", "--dynatemp-range", "--dynatemp-exp",
                     "--samplers", "--sampling-seq"),
                    "moestream samples with --temp, --top-k, --top-p, --min-p and the repeat, presence and "
                    "frequency penalties"),
}
# vLLM's flags (and llama-quantize's) with no counterpart here: what moestream does instead.
_ONE_GPU = ("moestream splits the layers over the GPUs of one host (--split-mode layer, --tensor-split A,B), no "
            "tensor or pipeline parallelism")
VLLM_NO_COUNTERPART = {
    "--tensor-parallel-size": _ONE_GPU, "-tp": _ONE_GPU, "--pipeline-parallel-size": _ONE_GPU, "-pp": _ONE_GPU,
    "--gpu-memory-utilization": "the GPU memory that caches experts is given in MiB: --moe-cache-mib MIB",
    "--trust-remote-code": "moestream runs no code from a model's directory; leave it out",
    "--quantization": "quantize the model to a GGUF first (moestream quantize IN OUT TYPE), then -m OUT",
}
QUANTIZE_NO_COUNTERPART = {
    "--imatrix": "moestream quantize takes no importance matrix; leave it out",
    "--leave-output-tensor": "--output-tensor-type f16 (or bf16, f32) keeps output.weight unquantized",
}
# Other programs' spellings of flags moestream has (vLLM, transformers' generate, OpenAI's fields, llama.cpp's
# -r/--reverse-prompt, which stops where its text appears as --stop does): flag -> ours.
OTHER_SPELLINGS = {"--temperature": "--temp", "--max-tokens": "-n", "--max-new-tokens": "-n", "--max-model-len": "-c",
                   "--n-ctx": "-c", "--max-num-seqs": "-np", "--max-num-batched-tokens": "-b",
                   "--enforce-eager": "--no-cuda-graphs", "-r": "--stop", "--reverse-prompt": "--stop"}
_NEGATIVE = re.compile(r"^-\d+$|^-\d*\.\d+$")


class UsageError(UserError):
    """A flag the command does not take, or a value it cannot read: the CLI exits 2, as argparse does."""


class Parser(argparse.ArgumentParser):
    """argparse.ArgumentParser with allow_abbrev=False, no splitting of `-xyz` into short flags, no unknown flags
    passed through, and errors as UsageError (one line) instead of usage text and SystemExit."""

    def __init__(self, *args, **kw):
        kw.setdefault("allow_abbrev", False)
        super().__init__(*args, **kw)

    def _parse_optional(self, arg_string):
        # An unknown `-xyz` is one unknown flag, not -x yz: it ends in the extras (refused below) unless a
        # REMAINDER argument takes it as a value (bench --compare "--cpu-moe").
        if _looks_glued(arg_string) and not self._known(arg_string):
            unknown = super()._parse_optional("--\0unknown")         # argparse's shape for an unknown flag
            if isinstance(unknown, list):                            # Python 3.12.7+: a list of tuples
                return [(None, arg_string, *unknown[0][2:])]
            return (None, arg_string, *unknown[2:])
        return super()._parse_optional(arg_string)

    def parse_known_args(self, args=None, namespace=None):
        self._args = list(args) if args is not None else []
        ns, extras = super().parse_known_args(args, namespace)
        if extras and self._subparsers is None:
            first = extras[0]
            self.error(self._unknown(first) if first.startswith("-") else f"unexpected argument {first!r}")
        return ns, extras

    def error(self, message):
        args = getattr(self, "_args", [])
        if message.startswith("the following arguments are required") or re.match(r"argument [A-Z]", message):
            flag = next((x for x in args if x.startswith("-") and x != "-" and " " not in x and not _NEGATIVE.match(x)
                         and not self._known(x)), None)
            if flag is not None:             # its value was taken for a positional argument: the flag is the mistake
                message = self._unknown(flag)
            elif "-m/--model" in message and args and not args[0].startswith("-"):
                message = f"the model is given with -m: -m {args[0]} (not as a positional argument, as vLLM takes it)"
        raise UsageError(f"{message} (`{self.prog} --help` lists the flags)")

    def _known(self, arg: str) -> bool:
        return arg in self._option_string_actions or arg.split("=", 1)[0] in self._option_string_actions

    def _unknown(self, arg: str) -> str:
        flag = arg.split("=", 1)[0]
        for whose, table in (("llama.cpp's", NO_COUNTERPART), ("vLLM's", VLLM_NO_COUNTERPART),
                             ("llama-quantize's", QUANTIZE_NO_COUNTERPART)):
            if flag in table:
                return f"{flag} is {whose}; moestream has no such flag: {table[flag]}"
        ours = self._option_string_actions.get(OTHER_SPELLINGS.get(flag.replace("_", "-"), flag.replace("_", "-")))
        if ours is not None:                # --temperature, --max_new_tokens: another program's spelling
            return f"unknown flag {flag}; moestream spells it {'/'.join(ours.option_strings)}"
        if len(flag) == 2:                  # one letter: a longer flag it begins is no likelier than any other
            return f"unknown flag {flag}"
        names = list(self._option_string_actions)
        longer = [n for n in names if n.startswith(flag)]           # an abbreviation: the flag it abbreviates
        close = longer[:1] if len(longer) == 1 else difflib.get_close_matches(flag, names, n=1, cutoff=0.5)
        return f"unknown flag {flag}" + (f"; did you mean {close[0]}?" if close else "")


def _looks_glued(arg: str) -> bool:
    """A single-dash token of more than one letter (`-ngl`, `-co`, `-fa`), which argparse would split, one letter
    (`-n` where -ngl and -ncmoe are flags), which it would take as their prefix, or a long flag it would take as an
    abbreviation; not a negative number or a value with spaces."""
    if not arg.startswith("-") or arg == "-" or " " in arg or _NEGATIVE.match(arg):
        return False
    return len(arg.split("=", 1)[0]) > 1
