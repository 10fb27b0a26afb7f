"""``temper tasksets import``: public datasets from local JSONL and parquet files with a
column mapping, Temper files, and Harbor / Terminal-Bench task directories; bad input
names its file, line and column."""

from __future__ import annotations

import json

import pytest

from temper.cli import main
from temper.cli.tasksets import import_tasks
from temper.tasks.datasets import DatasetError, import_file, parse_columns
from temper.tasks.harbor import HarborError, import_task_dir, import_task_dirs
from temper.tasks.models import TaskKind, parse_tasks
from tests.libs.tasks.fixtures import (
    GSM8K,
    HUMANEVAL,
    MBPP,
    harbor_task,
    terminal_bench_task,
    write_jsonl,
    write_parquet,
)

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet])
def test_humaneval_mbpp_and_gsm8k_from_jsonl_and_parquet(tmp_path, writer):
    ext = "jsonl" if writer is write_jsonl else "parquet"
    he = import_file("humaneval", writer(tmp_path / f"he.{ext}", HUMANEVAL))
    assert [t.id for t in he] == ["HumanEval/23", "HumanEval/45"]
    assert he[0].entry_point == "strlen" and he[0].files == {"solution.py": HUMANEVAL[0]["prompt"]}
    assert he[0].solution == HUMANEVAL[0]["prompt"] + "    return len(string)\n"
    mbpp = import_file("mbpp", writer(tmp_path / f"mbpp.{ext}", MBPP))
    assert [(t.id, t.entry_point) for t in mbpp] == [
        ("mbpp/2", "similar_elements"),
        ("mbpp/3", "is_not_prime"),
    ]
    assert MBPP[1]["test_list"][0] in mbpp[1].prompt and mbpp[1].tests.count("assert") == 3
    gsm = import_file("gsm8k", writer(tmp_path / f"gsm.{ext}", GSM8K))
    assert [(t.id, t.kind, t.answer) for t in gsm] == [
        ("gsm8k/1", TaskKind.math, "72"), ("gsm8k/2", TaskKind.math, "10")]  # fmt: skip


def test_a_column_mapping_reads_renamed_columns(tmp_path):
    # sanitized MBPP calls the problem "prompt"; some GSM8K copies use problem/solution
    renamed = [{("prompt" if k == "text" else k): v for k, v in r.items()} for r in MBPP]
    path = write_parquet(tmp_path / "sanitized.parquet", renamed)
    with pytest.raises(
        DatasetError, match=r"sanitized.parquet: row 1: column 'text': missing .*--columns text="
    ):
        import_file("mbpp", path)
    tasks = import_file("mbpp", path, parse_columns("text=prompt", "mbpp"))
    assert tasks[0].prompt.startswith("Write a function to find the similar elements")
    gsm = [{"problem": r["question"], "solution": r["answer"]} for r in GSM8K]
    mapped = import_file(
        "gsm8k",
        write_jsonl(tmp_path / "g.jsonl", gsm),
        parse_columns("question=problem,answer=solution", "gsm8k"),
    )
    assert [t.answer for t in mapped] == ["72", "10"]
    with pytest.raises(DatasetError, match="mbpp has no field 'prompt'"):
        parse_columns("prompt=text", "mbpp")
    with pytest.raises(DatasetError, match="is not FIELD=COLUMN"):
        parse_columns("text", "mbpp")


def test_bad_records_name_the_file_line_and_column(tmp_path):
    bad = write_jsonl(tmp_path / "he.jsonl", [HUMANEVAL[0], {**HUMANEVAL[1], "entry_point": 7}])
    with pytest.raises(
        DatasetError, match=r"^he.jsonl: line 2: column 'entry_point': expected non-empty text, got int 7"
    ):
        import_file("humaneval", bad)
    (tmp_path / "broken.jsonl").write_text(json.dumps(GSM8K[0]) + "\n{not json\n")
    with pytest.raises(DatasetError, match=r"^broken.jsonl: line 2: not valid JSON: .*\(column 2\)"):
        import_file("gsm8k", tmp_path / "broken.jsonl")
    no_final = write_parquet(tmp_path / "g.parquet", [GSM8K[0], {**GSM8K[1], "answer": "she earned 10"}])
    with pytest.raises(
        DatasetError, match=r"^g.parquet: row 2: column 'answer': has no '#### <answer>' line"
    ):
        import_file("gsm8k", no_final)
    tests_as_text = write_jsonl(tmp_path / "m.jsonl", [{**MBPP[0], "test_list": "assert f(1)"}])
    with pytest.raises(
        DatasetError, match=r"line 1: column 'test_list': expected a list of strings, got str"
    ):
        import_file("mbpp", tests_as_text)
    # a wrong mapping names the column the user gave
    with pytest.raises(
        DatasetError, match=r"line 1: column 'problem': missing \(the record has: answer, question\)"
    ):
        import_file("gsm8k", write_jsonl(tmp_path / "q.jsonl", GSM8K), {"question": "problem"})
    with pytest.raises(DatasetError, match="expected a .jsonl or .parquet file"):
        import_file("gsm8k", write_jsonl(tmp_path / "q.csv", GSM8K))
    (tmp_path / "x.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DatasetError, match="x.parquet: not a readable parquet file"):
        import_file("gsm8k", tmp_path / "x.parquet")


def test_harbor_and_terminal_bench_directories_become_shell_tasks(tmp_path):
    harbor = import_task_dir(harbor_task(tmp_path))
    assert harbor.kind is TaskKind.shell and harbor.id == "hello-world"
    assert (
        harbor.prompt
        == 'Create a file called hello.txt in the current directory with "Hello, world!" in it.\n'
    )
    assert harbor.files == {"greeting.txt": "Hello, world!\n"}
    # /app (the WORKDIR) is the workspace: the tests and the oracle use relative paths
    assert 'Path("hello.txt")' in (harbor.tests or "") and "/app" not in (harbor.tests or "")
    assert harbor.oracle == "#!/bin/bash\ncp greeting.txt hello.txt\n" and harbor.solution is None
    assert harbor.metadata.difficulty == 0.25 and harbor.metadata.tags == ["file-operations"]
    tb = import_task_dir(terminal_bench_task(tmp_path))
    assert tb.prompt == "Count the lines of data.txt and write the number to count.txt."
    assert tb.files == {"data.txt": "alpha\nbeta\ngamma\n"} and tb.metadata.difficulty == 0.5
    assert "wc -l < data.txt" in (tb.oracle or "")
    assert [t.id for t in import_task_dirs(tmp_path)] == ["count-lines", "hello-world"]


def test_task_directories_that_need_their_own_image_are_refused(tmp_path):
    d = harbor_task(
        tmp_path,
        "needs-apt",
        dockerfile="FROM ubuntu:24.04\nWORKDIR /app\nRUN apt-get update && \\\n    apt-get install -y jq\n",
    )
    with pytest.raises(
        HarborError, match=r"Dockerfile: line 3: 'RUN apt-get update .*needs its own Docker image"
    ):
        import_task_dir(d)
    d = terminal_bench_task(tmp_path, "two-containers")
    (d / "docker-compose.yaml").write_text(
        "services:\n  client:\n    build: .\n  redis:\n    image: redis:7\n"
    )
    with pytest.raises(HarborError, match=r"needs 2 containers \(client, redis\)"):
        import_task_dir(d)
    d = harbor_task(tmp_path, "no-oracle")
    (d / "solution" / "solve.sh").unlink()
    with pytest.raises(HarborError, match="no oracle solution"):
        import_task_dir(d)
    d = harbor_task(tmp_path, "hidden-data")
    (d / "tests" / "expected.json").write_text("{}")
    with pytest.raises(HarborError, match="expected.json: hidden files beside the Python tests"):
        import_task_dir(d)
    d = harbor_task(
        tmp_path, "copy-outside", dockerfile="FROM x\nWORKDIR /app\nCOPY greeting.txt /etc/motd\n"
    )
    with pytest.raises(HarborError, match=r"line 3: copies to '/etc/motd', outside the WORKDIR"):
        import_task_dir(d)
    d = terminal_bench_task(tmp_path, "copies-everything")
    (d / "Dockerfile").write_text("FROM x\nWORKDIR /app\nCOPY . /app\n")
    with pytest.raises(HarborError, match=r"line 3: copies solution.sh, which the agent must not see"):
        import_task_dir(d)
    d = harbor_task(tmp_path, "copies-a-dir", dockerfile="FROM x\nWORKDIR /app\nCOPY data/ /app/data/\n")
    (d / "environment" / "data" / "sub").mkdir(parents=True)
    (d / "environment" / "data" / ".env").write_text("A=1\n")
    (d / "environment" / "data" / "sub" / "x.csv").write_text("a,b\n")
    assert import_task_dir(d).files == {"data/.env": "A=1\n", "data/sub/x.csv": "a,b\n"}
    with pytest.raises(HarborError, match="none has tests/"):
        import_task_dirs(tmp_path / "needs-apt" / "solution")


def test_the_cli_writes_temper_jsonl_and_reports_bad_input(tmp_path, capsys):
    src = write_parquet(tmp_path / "test-00000-of-00001.parquet", MBPP)
    out = tmp_path / "mbpp.jsonl"
    assert main(["tasksets", "import", "mbpp", str(src), "--output", str(out)]) == 0
    tasks = parse_tasks(out.read_text(), filename="mbpp.jsonl")
    assert [t.id for t in tasks] == ["mbpp/2", "mbpp/3"]
    # a Temper file goes through the same parser as an upload
    assert [t.id for t in import_tasks("temper", str(out))] == ["mbpp/2", "mbpp/3"]
    assert main(["tasksets", "import", "harbor", str(harbor_task(tmp_path)), "--output", str(out)]) == 0
    assert json.loads(out.read_text())["kind"] == "shell"
    capsys.readouterr()
    assert (
        main(["tasksets", "import", "mbpp", str(src), "--columns", "text=prompt", "--output", str(out)]) == 2
    )
    assert "row 1: column 'prompt': missing" in capsys.readouterr().err
    assert main(["tasksets", "import", "temper", str(src), "--columns", "a=b"]) == 2
    assert "--columns is for humaneval, mbpp and gsm8k" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"id": "a", "prompt": "p"}\n')
    assert main(["tasksets", "import", "temper", str(tmp_path / "bad.jsonl"), "--output", str(out)]) == 2
    assert "bad.jsonl: line 1: (task): a code task needs hidden tests" in capsys.readouterr().err
