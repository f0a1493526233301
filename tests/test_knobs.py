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


def test_a_positive_whole_number_is_taken_or_warned_about(monkeypatch, caplog):
    assert knobs.positive_int("MOESTREAM_TEST_KNOB", 16) == 16
    monkeypatch.setenv("MOESTREAM_TEST_KNOB", "8")
    assert knobs.positive_int("MOESTREAM_TEST_KNOB", 16) == 8
    for bad in ("0", "-1", "eight"):
        monkeypatch.setenv("MOESTREAM_TEST_KNOB", bad)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="moestream"):
            assert knobs.positive_int("MOESTREAM_TEST_KNOB", 16) == 16
        assert "not a positive whole number" in caplog.text


def test_a_misspelt_delta_kernel_warns_where_it_used_to_pass_unnoticed(monkeypatch, caplog):
    from moestream.kernels.delta import pick_delta_kernels
    monkeypatch.setenv("MOESTREAM_DELTA", "fla-unfused")
    with caplog.at_level(logging.WARNING, logger="moestream"):
        pick_delta_kernels(torch.device("cpu"), torch.float32)
    assert "MOESTREAM_DELTA='fla-unfused' is not one of fla, torch" in caplog.text
