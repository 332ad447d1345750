"""Which policy version made each token of a response: the one rule the rollout client and its
streamed requests share."""

from __future__ import annotations


def token_versions(meta: dict, tokens: int, at_submit: int, paused_meanwhile: bool) -> list[int]:
    """Each output token's policy version: from SGLang's spans (``weight_versions``: which
    version made tokens ``[start, end)``) where the server sends them, else the response's
    ``weight_version`` for all (the one it started with when a pause fell in between: the
    oldest, so the staleness bound stays strict)."""
    spans = meta.get("weight_versions")
    if isinstance(spans, list) and spans:
        out = [at_submit] * tokens
        for span in spans:
            version = parse_version(span.get("version"), at_submit)
            for i in range(max(int(span.get("start", 0)), 0), min(int(span.get("end", 0)), tokens)):
                out[i] = version
        return out
    version = parse_version(meta.get("weight_version"), at_submit)
    if paused_meanwhile:  # an in-place pause: tokens from both sides of an update
        version = min(version, at_submit)
    return [version] * tokens


def parse_version(value: object, fallback: int) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return fallback
