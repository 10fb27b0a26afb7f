"""Small dataset files in the public releases' formats, written into a test's tmp dir:
two HumanEval problems, two MBPP problems, two GSM8K problems (records as published),
and task directories in the Harbor and Terminal-Bench layouts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

HUMANEVAL = [
    {
        "task_id": "HumanEval/23",
        "prompt": 'def strlen(string: str) -> int:\n    """ Return length of given string\n'
        "    >>> strlen('')\n    0\n    >>> strlen('abc')\n    3\n    \"\"\"\n",
        "canonical_solution": "    return len(string)\n",
        "test": "\n\nMETADATA = {\n    'author': 'jt',\n    'dataset': 'test'\n}\n\n\n"
        "def check(candidate):\n    assert candidate('') == 0\n    assert candidate('x') == 1\n"
        "    assert candidate('asdasnakj') == 9\n",
        "entry_point": "strlen",
    },
    {
        "task_id": "HumanEval/45",
        "prompt": 'def triangle_area(a, h):\n    """Given length of a side and high return area for a triangle.\n'
        '    >>> triangle_area(5, 3)\n    7.5\n    """\n',
        "canonical_solution": "    return a * h / 2.0\n",
        "test": "\n\nMETADATA = {}\n\n\ndef check(candidate):\n    assert candidate(5, 3) == 7.5\n"
        "    assert candidate(2, 2) == 2.0\n    assert candidate(10, 8) == 40.0\n",
        "entry_point": "triangle_area",
    },
]

MBPP = [
    {
        "task_id": 2,
        "text": "Write a function to find the similar elements from the given two tuple lists.",
        "code": "def similar_elements(test_tup1, test_tup2):\r\n  res = tuple(set(test_tup1) & set(test_tup2))\r\n"
        "  return (res) ",
        "test_list": [
            "assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))",
            "assert set(similar_elements((1, 2, 3, 4),(5, 4, 3, 7))) == set((3, 4))",
            "assert set(similar_elements((11, 12, 14, 13),(17, 15, 14, 13))) == set((13, 14))",
        ],
        "test_setup_code": "",
        "challenge_test_list": [],
    },
    {
        "task_id": 3,
        "text": "Write a python function to identify non-prime numbers.",
        "code": "import math\r\ndef is_not_prime(n):\r\n    result = False\r\n"
        "    for i in range(2,int(math.sqrt(n)) + 1):\r\n        if n % i == 0:\r\n"
        "            result = True\r\n    return result",
        "test_list": [
            "assert is_not_prime(2) == False",
            "assert is_not_prime(10) == True",
            "assert is_not_prime(35) == True",
        ],
        "test_setup_code": "",
        "challenge_test_list": [],
    },
]

GSM8K = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
        "in May. How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 "
        "clips altogether in April and May.\n#### 72",
    },
    {
        "question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
        "babysitting. How much did she earn?",
        "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned "
        "0.2 x 50 = $<<0.2*50=10>>10.\n#### 10",
    },
]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet(path: Path, records: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


TEST_OUTPUTS = """from pathlib import Path


def test_hello_file_exists():
    assert Path("/app/hello.txt").exists()


def test_hello_file_content():
    assert Path("/app/hello.txt").read_text().strip() == "Hello, world!"
"""


def harbor_task(root: Path, name: str = "hello-world", *, dockerfile: str | None = None) -> Path:
    """A task in Harbor's layout: instruction.md, task.toml, environment/, solution/, tests/."""
    d = root / name
    (d / "environment").mkdir(parents=True)
    (d / "solution").mkdir()
    (d / "tests").mkdir()
    (d / "instruction.md").write_text('Create a file called hello.txt in /app with "Hello, world!" in it.\n')
    (d / "task.toml").write_text(
        'version = "1.0"\n\n[metadata]\ndifficulty = "easy"\ncategory = "file-operations"\n'
        'tags = ["file-operations"]\n\n[verifier]\ntimeout_sec = 120.0\n'
    )
    (d / "environment" / "Dockerfile").write_text(
        dockerfile or "FROM ubuntu:24.04\n\nWORKDIR /app\nCOPY greeting.txt /app/greeting.txt\n"
    )
    (d / "environment" / "greeting.txt").write_text("Hello, world!\n")
    (d / "solution" / "solve.sh").write_text("#!/bin/bash\ncp /app/greeting.txt /app/hello.txt\n")
    (d / "tests" / "test.sh").write_text("#!/bin/bash\nuvx pytest /tests/test_outputs.py\n")
    (d / "tests" / "test_outputs.py").write_text(TEST_OUTPUTS)
    return d


def terminal_bench_task(root: Path, name: str = "count-lines") -> Path:
    """A task in Terminal-Bench's layout: task.yaml with the instruction, Dockerfile,
    docker-compose.yaml (one service), solution.sh, run-tests.sh, tests/."""
    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "task.yaml").write_text(
        "instruction: |-\n  Count the lines of /app/data.txt and write the number to /app/count.txt.\n"
        "author_email: someone@example.com\ndifficulty: medium\ntags:\n  - file-operations\n"
        "max_agent_timeout_sec: 360.0\n"
    )
    (d / "Dockerfile").write_text(
        "FROM ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624\n\nWORKDIR /app\nCOPY data.txt /app/\n"
    )
    (d / "data.txt").write_text("alpha\nbeta\ngamma\n")
    (d / "docker-compose.yaml").write_text(
        "services:\n  client:\n    build:\n      dockerfile: Dockerfile\n    image: ${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}\n"
    )
    (d / "solution.sh").write_text("#!/bin/bash\nwc -l < /app/data.txt | tr -d ' ' > /app/count.txt\n")
    (d / "run-tests.sh").write_text("#!/bin/bash\npytest $TEST_DIR/test_outputs.py -rA\n")
    (d / "tests" / "test_outputs.py").write_text(
        "from pathlib import Path\n\n\ndef test_count():\n"
        '    assert Path("/app/count.txt").read_text().strip() == "3"\n'
    )
    return d
