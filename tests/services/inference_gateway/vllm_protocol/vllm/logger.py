"""STUB of vllm/logger.py: a standard logger with vLLM's ``*_once`` helpers."""

import logging


class _Logger(logging.LoggerAdapter):
    def warning_once(self, msg, *args, **kwargs):
        self.warning(msg, *args)

    def info_once(self, msg, *args, **kwargs):
        self.info(msg, *args)

    def debug_once(self, msg, *args, **kwargs):
        self.debug(msg, *args)


def init_logger(name):
    return _Logger(logging.getLogger(name), {})
