"""Measure a finished `temper run examples/debug-job.yaml`: the reward of its first and last
policy versions with the tool outputs shown, and with them blanked.

    .venv/bin/python examples/debug_eval.py runs/<run-id> [--episodes 64]

Blanked, the ``run_tests`` and ``edit`` tools still run (the edit still changes the file)
but print ``(output hidden)`` instead of what they printed, so the policy cannot read which
literal the tests want: a policy that learned to read the failure should fall back to about
one right fix in five (the literals the task could want). Each measurement is a ``temper
run`` of one iteration on the version's model directory with the job's tasks and a learning
rate of 1e-9 (the trainer's versions are the same weights), its episodes sampled as the
job's were. Also counts, of the trajectories the run trained on, those whose tokens came
from two versions or more. Writes ``eval.json`` into the run directory and prints it all.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from temper.trajectory import Trajectory

ROOT = Path(__file__).resolve().parents[1]
BLANK = "> /dev/null 2>&1; echo '(output hidden)'"


def partial_figures(run_dir: Path) -> dict[str, float | int]:
    """Of the trajectories the trainer stepped on: how many, the share whose tokens came from
    two versions or more, and the model turns a new version cut mid-generation."""
    with sqlite3.connect(run_dir / "temper.db") as db:
        keys = [
            k for (k,) in db.execute("SELECT trajectory_key FROM trained_trajectories WHERE step IS NOT NULL")
        ]
    spanning = cut = 0
    for key in keys:
        t = Trajectory.model_validate_json((run_dir / "objects" / key).read_text())
        spanning += len(t.versions_spanned) > 1
        cut += sum(len(set(s.token_versions or [])) > 1 for s in t.segments if s.role == "model")
    return {
        "trained_trajectories": len(keys),
        "spanning_versions": spanning,
        "spanning_share": round(spanning / len(keys), 4) if keys else 0.0,
        "turns_cut_mid_generation": cut,
    }


def last_version(run_dir: Path) -> Path:
    """The newest full version the run's trainer published (a model directory)."""
    found = sorted(
        (run_dir / "objects").glob("tenants/*/jobs/*/versions/v*/config.json"),
        key=lambda p: int(p.parent.name[1:]),
    )
    if not found:
        raise SystemExit(f"{run_dir}: no published full version under objects/")
    return found[-1].parent


def eval_spec(run_dir: Path, model: Path, *, blanked: bool, episodes: int) -> dict:
    spec = yaml.safe_load((run_dir / "spec.yaml").read_text())
    local = spec.pop("local")
    if blanked:
        for tool in spec["environment"]["tools"]:
            if tool.get("command"):
                tool["command"] = f"{tool['command']} {BLANK}"
    spec["policy"]["model"] = str(model)
    spec["algorithm"]["learning_rate"] = 1e-9
    spec["schedule"].update(iterations=1, episodes_per_iteration=episodes)
    taskset = Path(local["taskset_file"])
    spec["local"] = {"taskset_file": str(taskset if taskset.is_absolute() else ROOT / "examples" / taskset)}
    return spec


def measure(run_dir: Path, model: Path, *, blanked: bool, episodes: int, out: Path) -> float:
    name = f"{'blanked' if blanked else 'shown'}-{model.name}"
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(eval_spec(run_dir, model, blanked=blanked, episodes=episodes)))
    cmd = [str(ROOT / ".venv/bin/temper"), "run", str(path), "--runs-dir", str(out), "--run-id", name]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((out / name / "summary.json").read_text())
    return float(summary["first_mean_reward"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--episodes", type=int, default=64)
    args = parser.parse_args()
    run_dir = args.run_dir.resolve()
    models = {"first (v0)": run_dir / "policy-v0", "last": last_version(run_dir)}
    results: dict[str, dict[str, float | str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, model in models.items():
            results[label] = {
                "model": str(model),
                "shown": measure(run_dir, model, blanked=False, episodes=args.episodes, out=Path(tmp)),
                "blanked": measure(run_dir, model, blanked=True, episodes=args.episodes, out=Path(tmp)),
            }
    partial = partial_figures(run_dir)
    (run_dir / "eval.json").write_text(
        json.dumps({"episodes": args.episodes, **results, "partial_rollouts": partial}, indent=2)
    )
    out = sys.stdout
    out.write(
        f"trained trajectories {partial['trained_trajectories']}: {partial['spanning_versions']} span two "
        f"versions or more ({partial['spanning_share']:.1%}); {partial['turns_cut_mid_generation']} model "
        "turns were cut mid-generation by a new version\n"
    )
    out.write(f"{'policy':<12} {'outputs shown':>14} {'outputs blanked':>16}\n")
    for label, r in results.items():
        out.write(f"{label:<12} {r['shown']:>14.3f} {r['blanked']:>16.3f}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
