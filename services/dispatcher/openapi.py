"""``python -m services.dispatcher.openapi [PATH]``: write the dispatcher's OpenAPI
document (default ``docs/openapi.json``). CI checks the checked-in copy is current."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from services.dispatcher.app import create_app
from temper.settings import Settings

DEFAULT_PATH = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"


def openapi_document() -> dict[str, Any]:
    return create_app(Settings(), run_episodes=False).openapi()


def render() -> str:
    return json.dumps(openapi_document(), indent=2, sort_keys=False) + "\n"


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else DEFAULT_PATH
    path.write_text(render())
    sys.stdout.write(f"wrote {path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
