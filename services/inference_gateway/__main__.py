"""``python -m services.inference_gateway``: the gateway on port 8001 (``TEMPER_PORT``).

Backends, timeouts and limits come from ``TEMPER_INFERENCE__*`` (see temper.settings.inference);
bus and object store from ``TEMPER_BUS__*``/``TEMPER_STORAGE__*``. Bad settings or an
unreachable broker print one line naming the setting and exit with status 2.
"""

from services.inference_gateway.app import create_app
from temper.runtime import run_service

if __name__ == "__main__":
    try:  # the proxy hop is event-loop bound: uvloop roughly halves its cost
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    run_service(create_app, "inference-gateway", default_port=8001)
