"""The environment's measurement knobs (moestream/knobs.py): a value outside a knob's choices warns and keeps the
default, never changes what runs unnoticed."""
from __future__ import annotations

import logging

import torch

from moestream import knobs


def test_a_choice_is_taken_or_warned_about_and_the_default_kept(monkeypatch, caplog):
    assert knobs.choice("MOESTREAM_TEST_KNOB", ("a", "b"), "a") == "a"            # unset: the default, silently
    assert not caplog.records
    monkeypatch.setenv("MOESTREAM_TEST_KNOB", "b")
    assert knobs.choice("MOESTREAM_TEST_KNOB", ("a", "b"), "a") == "b"
    monkeypatch.setenv("MOESTREAM_TEST_KNOB", "c")
    with caplog.at_level(logging.WARNING, logger="moestream"):
        assert knobs.choice("MOESTREAM_TEST_KNOB", ("a", "b"), "a") == "a"
    assert "MOESTREAM_TEST_KNOB='c' is not one of a, b: a" in caplog.text


def test_knobs_py_lists_every_environment_name_the_code_reads():
    """Every MOESTREAM_* name read (knobs.choice, os.environ) is in knobs.py's list, and no more than three remain."""
    import pathlib
    import re
    root = pathlib.Path(knobs.__file__).parent
    read = set()
    for f in root.rglob("*.py"):
        read |= set(re.findall(r'(?:choice|environ\.get|getenv)\(\s*"(MOESTREAM_[A-Z_]+)"', f.read_text()))
    listed = set(re.findall(r"^    (MOESTREAM_[A-Z_]+)=", knobs.__doc__, re.M))
    assert read == listed and len(listed) <= 3, (read, listed)


def test_a_misspelt_delta_kernel_warns_where_it_used_to_pass_unnoticed(monkeypatch, caplog):
    from moestream.kernels.delta import pick_delta_kernels
    monkeypatch.setenv("MOESTREAM_DELTA", "fla-unfused")
    with caplog.at_level(logging.WARNING, logger="moestream"):
        pick_delta_kernels(torch.device("cpu"), torch.float32)
    assert "MOESTREAM_DELTA='fla-unfused' is not one of fla, torch" in caplog.text
