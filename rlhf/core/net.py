"""Network probes with a timeout, and URLs as messages may show them (no credentials, path or query)."""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request


def http_status(url: str, timeout: float) -> tuple[int | None, str | None]:
    """(HTTP status, None) when something answers HTTP at `url` within `timeout` s, else (None, why not)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, None
    except urllib.error.HTTPError as e:
        return e.code, None
    except (OSError, ValueError) as e:
        return None, str(getattr(e, "reason", e))


def shown(url: str) -> str:
    """scheme://host[:port] of a URL from the environment: its user:password@, path and query stay out of messages."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = f":{parts.port}" if parts.port else ""
    except ValueError:  # a port that is not a number
        return "(unparsable URL)"
    return f"{parts.scheme}://{parts.hostname}{port}" if parts.hostname else "(unparsable URL)"
