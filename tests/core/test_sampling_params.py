"""SamplingParams: vLLM's defaults and validation of every field."""

from __future__ import annotations

import pytest

from pagedllm import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert p.n == 1
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == 0
    assert p.min_p == 0.0
    assert p.seed is None
    assert p.max_tokens == 16
    assert p.stop is None
    assert p.stop_token_ids is None
    assert p.ignore_eos is False
    assert p.include_stop_str_in_output is False
    assert p.skip_special_tokens is True
    assert p.stop_strings == []
    assert not p.is_greedy


def test_greedy_only_at_temperature_zero():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(n=5),
        dict(temperature=0.0),
        dict(temperature=2),  # an int is a number too
        dict(temperature=100.0),
        dict(top_p=1e-6),
        dict(top_p=1),
        dict(top_k=-1),
        dict(top_k=0),
        dict(top_k=1),
        dict(top_k=50),
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(min_p=0.5),
        dict(seed=0),
        dict(seed=-7),
        dict(seed=2**40),
        dict(max_tokens=1),
        dict(max_tokens=None),
        dict(stop_token_ids=[]),
        dict(stop_token_ids=[0, 2, 49151]),
        dict(stop_token_ids=(5, 6)),
    ],
)
def test_valid_values_are_accepted(kwargs):
    p = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        if name == "stop_token_ids":
            assert p.stop_token_ids == list(value)
        else:
            assert getattr(p, name) == value


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=-1), "temperature"),
        (dict(temperature="hot"), "temperature"),
        (dict(temperature=None), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=-0.5), "top_p"),
        (dict(top_p=1.0001), "top_p"),
        (dict(top_p=2), "top_p"),
        (dict(top_p="0.9"), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=-100), "top_k"),
        (dict(top_k=1.5), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(min_p=-0.01), "min_p"),
        (dict(min_p=1.01), "min_p"),
        (dict(min_p=2), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-1), "max_tokens"),
        (dict(max_tokens=1.0), "max_tokens"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(n=0), "n"),
        (dict(n=-1), "n"),
        (dict(n=1.0), "n"),
        (dict(n=True), "n"),
        (dict(seed=1.5), "seed"),
        (dict(seed="42"), "seed"),
        (dict(seed=True), "seed"),
        (dict(stop=3), "stop"),
        (dict(stop=["ok", 3]), "stop"),
        (dict(stop=[None]), "stop"),
        (dict(stop={"a": 1}), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop_token_ids=[3, -5]), "stop_token_ids"),
        (dict(stop_token_ids=[1.0]), "stop_token_ids"),
        (dict(stop_token_ids=[True]), "stop_token_ids"),
        (dict(stop_token_ids=7), "stop_token_ids"),
        (dict(stop_token_ids="12"), "stop_token_ids"),
    ],
)
def test_invalid_values_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert field in message
    # the message shows what was passed, so the user can find the bad value
    assert repr(kwargs[field]) in message


def test_nan_temperature_raises():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))


@pytest.mark.parametrize("stop", ["", ["", "x"], ["x", ""]])
def test_empty_stop_string_raises(stop):
    with pytest.raises(ValueError, match="empty"):
        SamplingParams(stop=stop)


@pytest.mark.parametrize(
    "stop, expected",
    [
        (None, []),
        ("###", ["###"]),
        (["a", "bc"], ["a", "bc"]),
        (("a", "bc"), ["a", "bc"]),
        ([], []),
    ],
)
def test_stop_strings_are_normalised_to_a_list(stop, expected):
    assert SamplingParams(stop=stop).stop_strings == expected


def test_stop_strings_are_not_shared_between_instances():
    a = SamplingParams(stop=["x"])
    b = SamplingParams()
    assert b.stop_strings == []
    assert a.stop_strings is not b.stop_strings
