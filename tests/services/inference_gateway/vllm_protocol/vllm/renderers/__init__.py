"""STUB of vllm/renderers: TokenizeParams is built only by methods the tests do not call."""


class TokenizeParams:  # noqa: D101
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)
