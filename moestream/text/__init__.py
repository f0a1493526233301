"""Text: the tokenizer, chat templates and the synth tokenizer's training text, below loading (which needs them).

    from moestream.text.tokenizer import Tokenizer, synth_tokenizer
    ids = synth_tokenizer().encode("Hello world")
"""
