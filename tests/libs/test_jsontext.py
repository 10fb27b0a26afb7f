"""The JSON columns' text (temper.db.jsontext) reads back what json would."""

from __future__ import annotations

import json
from enum import StrEnum

from temper.db import jsontext


class Colour(StrEnum):
    red = "red"


def test_values_read_back_as_json_reads_them() -> None:
    value = {
        "token_ids": [0, 1, 50_000],
        "logprobs": [-0.125, -3.5e-08, 0.0],
        "text": 'naïve ✓ \n\t"quoted"',
        "nested": {"a": [None, True, False, {"b": []}]},
        "state": Colour.red,
        "big": 2**70,  # past 64 bits: json writes it
        1: "an int key",
    }
    text = jsontext.dumps(value)
    assert jsontext.loads(text) == json.loads(json.dumps(value))
    assert jsontext.loads(text.encode())["big"] == 2**70
    assert jsontext.loads(text)["1"] == "an int key"


def test_a_float_is_exact() -> None:
    floats = [0.1, 1 / 3, -2.5e-300, 1e300, 123456789.123456789]
    assert jsontext.loads(jsontext.dumps(floats)) == floats
