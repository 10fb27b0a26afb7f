"""The TRL side of ``bench/learn.py``: Hugging Face TRL's ``GRPOTrainer`` on the example
job's task, policy, prompts, reward and settings, and the reward function both sides share.

The reward is Temper's own: the code environment's parser reads the completion (as the
dispatcher does), the file it writes joins the task's starting files (what the episode's
workspace snapshot holds after a ``write_file`` action), and Temper's
:class:`temper.rewards.Scorer` scores it with the job's weights, through Temper's test
harness. Only where the harness runs differs: in a plain subprocess (``plain``: no
isolation at all), or in a bubblewrap sandbox made for each run (``bwrap``: new user, pid,
mount, network, IPC and UTS namespaces, the host's /usr read-only, a fresh workspace and
/tmp; the fairest cheap isolation a TRL user would add). Runs go ``--reward-workers`` at a
time (threads that wait on the subprocesses).

    python bench/learn_trl.py --spec SPEC --mode bwrap|plain --out OUT.json [--seed 0]

``SPEC`` is the derived spec ``bench/learn.py`` writes (the example job with
``policy.model`` = the warm-started ``policy-v0`` directory). Writes, per batch, when its
rewards were known (seconds from the start of training), their mean, and when its
optimizer step ended.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "libs")]

from services.embedded import localrun  # noqa: E402
from temper.envs import Environment, make_environment  # noqa: E402
from temper.jobspec import JobSpec  # noqa: E402
from temper.policy import ChatTokenizer  # noqa: E402
from temper.policy.tokenizer import assistant_stop_ids, policy_tokenizer  # noqa: E402
from temper.rewards import Scorer  # noqa: E402
from temper.sandbox import Action, ExecResult, KillReason, SandboxLimits  # noqa: E402
from temper.tasks.models import TaskSpec, parse_tasks  # noqa: E402

PYTHON = "/usr/bin/python3"  # the interpreter Temper's scoring sandboxes run


# --- the reward --------------------------------------------------------------------------------
class _RunSettings:
    python = PYTHON


class SubprocessRuns:
    """What :class:`temper.rewards.runner.TestRunner` asks of a sandbox manager
    (``settings.python`` and ``run_fresh``), with each run in a plain subprocess or in a
    bubblewrap sandbox of its own, in an empty temporary workspace."""

    settings = _RunSettings()

    def __init__(self, mode: str, workers: int) -> None:
        if mode not in ("plain", "bwrap"):
            raise ValueError(f"mode is plain or bwrap, not {mode!r}")
        if mode == "bwrap" and shutil.which("bwrap") is None:
            sys.exit("bench/learn_trl.py --mode bwrap needs bubblewrap (make setup-run installs it)")
        self.mode = mode
        self.workers = workers
        self._gate: asyncio.Semaphore | None = None  # made on the loop that runs the scores
        self.runs = 0

    @property
    def gate(self) -> asyncio.Semaphore:
        if self._gate is None:
            self._gate = asyncio.Semaphore(self.workers)
        return self._gate

    def argv(self, code: str, workspace: str) -> list[str]:
        run = [PYTHON, "-c", code]
        if self.mode == "plain":
            return run
        return [
            "bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
            "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
            "--bind", workspace, "/work", "--chdir", "/work", *run,
        ]  # fmt: skip

    async def run_fresh(
        self, limits: SandboxLimits, files: dict[str, bytes], action: Action
    ) -> tuple[ExecResult, dict[str, bytes | None]]:
        assert action.kind == "run_python" and not files, "the harness writes the files itself"
        async with self.gate:
            self.runs += 1
            with tempfile.TemporaryDirectory(prefix="learn-trl-") as ws:
                os.chmod(ws, 0o755)
                env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
                t0 = time.monotonic()
                proc = await asyncio.create_subprocess_exec(
                    *self.argv(action.code or "", ws), cwd=ws, env=env, stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                )  # fmt: skip
                kill = None
                try:
                    out, err = await asyncio.wait_for(
                        proc.communicate((action.stdin or "").encode()), timeout=limits.wall_s
                    )
                except TimeoutError:
                    proc.kill()
                    out, err = await proc.communicate()
                    kill = KillReason.timeout
        result = ExecResult(
            exit_code=proc.returncode if kill is None else None,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            kill_reason=kill,
            wall_s=time.monotonic() - t0,
        )
        return result, {}


def environment(spec: JobSpec, task: TaskSpec) -> Environment:
    """The code environment of ``task`` as the dispatcher makes it for the job's episodes."""
    env = spec.environment
    return make_environment(
        env.kind or task.kind,
        {"id": task.id, "kind": task.kind, "prompt": task.prompt, "spec": {"files": dict(task.files)}},
        max_turns=env.max_turns,
        action_format=env.action_format,
        limits=env.limits,
        system_prompt=env.system_prompt,
        tools=env.tools,
        tool_role=env.tool_role,
    )


class Reward:
    """Temper's reward of a one-turn code episode from its completion's token ids."""

    def __init__(
        self, spec: JobSpec, tasks: list[TaskSpec], tok: ChatTokenizer, runs: SubprocessRuns
    ) -> None:
        if spec.environment.max_turns != 1:
            raise ValueError("the comparison is for one-turn episodes (environment.max_turns: 1)")
        self.spec = spec
        self.tasks = tasks
        self.envs = [environment(spec, t) for t in tasks]
        self.tok = tok
        self.runs = runs
        self.scorer = Scorer(runs)  # type: ignore[arg-type]  # duck-typed: run_fresh and settings

    def submission(self, index: int, ids: list[int]) -> tuple[dict[str, Any], bool]:
        """What the dispatcher sends the scorer for this completion, and its format flag: a
        ``write_file`` action's file over the task's starting files (the snapshot of the
        session that ran it); the final text for anything else."""
        env, tok = self.envs[index], self.tok
        text = tok.decode(ids)
        action = env.parse(tok.parse_text(ids, text), turn=0)
        files: dict[str, str] = {}
        if action.kind == "sandbox":
            files = env.setup_files()
            command = action.command or {}
            if command.get("kind") == "write_file":
                files[str(command["path"])] = str(command.get("content") or "")
        format_ok = action.kind == "sandbox" or action.format_ok
        return {"kind": "code", "files": files, "text": text}, format_ok

    async def score(self, index: int, ids: list[int]) -> float:
        submission, format_ok = self.submission(index, ids)
        reward, _ = await self.scorer.score(
            self.tasks[index],
            submission,
            dict(self.spec.rewards),
            turns_used=1,
            max_turns=1,
            format_ok=format_ok,
        )
        return reward

    async def score_all(self, items: list[tuple[int, list[int]]]) -> list[float]:
        return list(await asyncio.gather(*(self.score(i, ids) for i, ids in items)))


def load_task_side(spec_path: Path) -> tuple[JobSpec, list[TaskSpec], ChatTokenizer]:
    spec, local = localrun.load(spec_path)
    tasks = parse_tasks(local.taskset_file.read_bytes(), filename=local.taskset_file.name)
    tok = policy_tokenizer(spec.policy.model)
    return spec, tasks, tok


# --- the trainer -------------------------------------------------------------------------------
def train(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec, tasks, tok = load_task_side(Path(args.spec))
    policy = Path(spec.policy.model)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_file=str(policy / "tokenizer.json"),
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
    )
    hf_tok.padding_side = "left"
    prompt_ids = [environment(spec, t).first_prompt_ids(tok) for t in tasks]
    prompts = [hf_tok.decode(ids, skip_special_tokens=False) for ids in prompt_ids]
    for ids, text in zip(prompt_ids, prompts, strict=True):
        again = hf_tok(text=text)["input_ids"]
        if again != ids:
            sys.exit(f"TRL would see other prompt token ids than Temper: {again[:12]}... vs {ids[:12]}...")
    dataset = Dataset.from_dict({"prompt": prompts, "task_index": list(range(len(tasks)))})
    model = AutoModelForCausalLM.from_pretrained(str(policy), dtype=torch.float32)

    loop = asyncio.new_event_loop()  # the reward's runs, on a loop of their own (a thread)
    threading.Thread(target=loop.run_forever, daemon=True, name="reward-loop").start()
    runs = SubprocessRuns(args.mode, args.reward_workers)
    reward = Reward(spec, tasks, tok, runs)
    clock: dict[str, float] = {}
    batches: list[dict[str, float]] = []

    def reward_fn(
        completions: list[str], completion_ids: list[list[int]], task_index: list[int], **_: Any
    ) -> list[float]:
        t0 = time.perf_counter()
        items = list(zip(task_index, [list(c) for c in completion_ids], strict=True))
        scores = asyncio.run_coroutine_threadsafe(reward.score_all(items), loop).result()
        now = time.perf_counter()
        batches.append({
            "rewards_at": now - clock["start"], "mean": sum(scores) / len(scores), "reward_s": now - t0,
            "samples": len(scores),
        })  # fmt: skip
        return scores

    s, a = spec.policy.sampling, spec.algorithm
    per_batch = a.groups_per_step * spec.tasks.group_size
    if spec.schedule.episodes_per_iteration != per_batch:
        sys.exit(
            "the comparison needs one optimizer step per iteration (episodes_per_iteration = groups x size)"
        )
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=per_batch,
            num_generations=spec.tasks.group_size,
            max_completion_length=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=0,
            generation_kwargs={"eos_token_id": assistant_stop_ids(tok), "pad_token_id": tok.pad_id},
            learning_rate=a.learning_rate,
            epsilon=a.clip_eps,
            epsilon_high=a.clip_eps_high if a.clip_eps_high is not None else a.clip_eps,
            max_grad_norm=a.max_grad_norm,
            weight_decay=0.0,  # TEMPER_TRAINER__WEIGHT_DECAY's default
            beta=a.kl_coef,
            loss_type="dapo",  # token-level mean over the batch: Temper's grpo preset (token_mean)
            scale_rewards="group",  # (r - mean) / (std + 1e-4) within the group: group_norm
            num_iterations=1,  # one optimizer step per batch
            gradient_checkpointing=False,
            max_steps=args.iterations,
            lr_scheduler_type="constant",
            warmup_steps=0,
            logging_steps=10**6,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            use_cpu=True,
            seed=args.seed,
            dataloader_num_workers=0,
        )

        class Clock(TrainerCallback):
            def on_train_begin(self, *_: Any, **__: Any) -> None:
                clock["start"] = time.perf_counter()

            def on_step_end(self, *_: Any, **__: Any) -> None:
                batches[-1]["step_end"] = time.perf_counter() - clock["start"]

        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward_fn,
            args=config,
            train_dataset=dataset,
            processing_class=hf_tok,
            callbacks=[Clock()],
        )
        trainer.train()
    return {
        "mode": args.mode,
        "seed": args.seed,
        "batches": batches,
        "rl_s": batches[-1]["step_end"],
        "samples": sum(int(b["samples"]) for b in batches),
        "reward_runs": runs.runs,
        "torch_threads": torch.get_num_threads(),
        "reward_workers": args.reward_workers,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", required=True)
    ap.add_argument("--mode", required=True, choices=["plain", "bwrap"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--reward-workers", type=int, default=4)
    args = ap.parse_args()
    result = train(args)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
