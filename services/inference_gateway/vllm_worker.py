"""Runs inside a vLLM server, not in the gateway: the worker methods the gateway calls through
``POST /collective_rpc`` for a full-weight reload.

Start vLLM with ``--worker-extension-cls services.inference_gateway.vllm_worker.TemperWorkerExtension``
and this checkout on its ``PYTHONPATH`` (the module imports nothing of Temper's).

Why not vLLM's own ``reload_weights``: it reloads an untied model correctly, but with tied
embeddings (Qwen2.5-0.5B and 1.5B) the output layer is not reloaded at all: the model's
``load_weights`` skips ``lm_head.*`` when the embedding is tied, so vLLM's layerwise reload
finds nothing for ``lm_head`` ("ParallelLMHead: Failed to load weights") and puts back the
tensors it had. On the CPU the output layer computes from a copy of the weight packed for
the GEMM kernel at load time (``dispatch_cpu_unquantized_gemm``), so it keeps producing the
old weights' logits although the embedding it shares storage with is new. After the reload
this method runs the output layer's post-load step again, which repacks it from the
embedding (checked by logprobs against Hugging Face in tests/services/inference_gateway/
test_vllm_server.py).
"""

from __future__ import annotations

from typing import Any


class TemperWorkerExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``: ``self`` is the worker."""

    def temper_reload_weights(self, weights_path: str, tag: dict[str, Any] | None = None) -> dict[str, Any]:
        """Load the weights of the model directory ``weights_path`` in place, tied output layer
        included, and keep ``tag`` (whose version they are: ``{job_id, version}``, None for the
        base) for :meth:`temper_loaded`; answers what was done, for the gateway to check."""
        # a reload that fails half-way leaves weights of no known version: reported as such
        self.temper_tag: dict[str, Any] | None = {"failed_reload": weights_path}
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        done = {"weights_path": weights_path, **refresh_tied_output(model)}
        self.temper_tag = tag
        return done

    def temper_loaded(self) -> dict[str, Any]:
        """Whose weights this worker holds (the last reload's tag; None: those it started with).
        A restarted gateway reads it, so what it routes by is what the server says."""
        return {"tag": getattr(self, "temper_tag", None)}


def refresh_tied_output(model: Any) -> dict[str, Any]:
    """Re-run the post-load step of an output layer tied to the embedding (nothing for an untied
    model); the layer must read the embedding's storage, which is checked, not assumed."""
    config = getattr(model, "config", None)
    lm_head = getattr(model, "lm_head", None)
    lm_head = getattr(lm_head, "base_layer", lm_head)  # under a LoRA wrapper
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not getattr(config, "tie_word_embeddings", False) or lm_head is None or embed is None:
        return {"tied": False}
    shared = lm_head.weight.data_ptr() == embed.weight.data_ptr()
    if not shared:
        lm_head.weight.data.copy_(embed.weight.data)
    method = getattr(lm_head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(lm_head)
    return {"tied": True, "shared_storage": shared, "repacked": method is not None}
