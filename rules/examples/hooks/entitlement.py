#!/usr/bin/env python3
"""A model entitlement check: the event on stdin, the user from metadata.user_id
(or the x-team header), the models each may use from a JSON file:
{"alice": ["claude-sonnet-*"], "*": ["claude-haiku-*"]}. Exit 0 with a block
decision when the model is not theirs; empty stdout lets the request go.
entitlement-service.py serves the same check over HTTP."""
import fnmatch
import json
import os
import sys


def decide(event, path):
    """The decision for one event: {} to let it go, else a block."""
    with open(path) as f:
        entitled = json.load(f)
    payload = event.get("payload") or {}
    headers = event.get("headers") or {}
    user = (payload.get("metadata") or {}).get("user_id") or headers.get("x-team") or "*"
    # Claude Code's user_id is itself JSON: its account (or, signed out, its device).
    if user.startswith("{"):
        try:
            ids = json.loads(user)
            user = ids.get("account_uuid") or ids.get("device_id") or "*"
        except ValueError:
            pass
    model = event.get("model") or ""
    allowed = entitled.get(user, entitled.get("*", []))
    if any(fnmatch.fnmatch(model, pattern) for pattern in allowed):
        return {}
    return {"block": {
        # 451: Claude Code shows the message once and does not retry (a 403 reads
        # "Failed to authenticate").
        "status": 451,
        "type": "permission_error",
        "message": f"{user} has no entitlement to {model}",
    }}


if __name__ == "__main__":
    decision = decide(json.load(sys.stdin), os.environ.get("ENTITLEMENTS_FILE", "entitlements.json"))
    if decision:
        print(json.dumps(decision))
