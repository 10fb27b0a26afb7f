"""STUB of vllm/config: ModelConfig is only a type annotation of methods the tests do not call."""


class ModelConfig:  # noqa: D101
    pass
