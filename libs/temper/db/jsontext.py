"""The text of the database's JSON columns (steps' requests and results, episodes'
rewards and timings, job specs): written and read with orjson, which does either in a
tenth to a third of the time of the standard library's ``json`` on a step's result. The
dispatcher decodes and encodes these on every result; with ``json`` that was about 7 % of
its CPU (``make bench-dispatch``).

The values are the same as ``json`` writes and reads, with two differences of form: the
text is compact (no spaces), and a float that is not finite is written as ``null``
(``json`` writes ``NaN``, which Postgres refuses). An integer past 64 bits, which orjson
refuses, is written by ``json``; dict keys that are not strings become strings as with
``json``."""

from __future__ import annotations

import json
from typing import Any

import orjson

loads = orjson.loads  # text or bytes


def dumps(value: Any) -> str:
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:  # e.g. an integer past 64 bits: json writes every value it can
        return json.dumps(value)
