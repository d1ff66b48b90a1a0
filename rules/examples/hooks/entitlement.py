#!/usr/bin/env python3
"""A model entitlement check: the event on stdin, the user from metadata.user_id
(or the x-team header), the models each may use from a JSON file:
{"alice": ["claude-sonnet-*"], "*": ["claude-haiku-*"]}. Exit 0 with a block
decision when the model is not theirs; empty stdout lets the request go."""
import fnmatch
import json
import os
import sys

event = json.load(sys.stdin)
path = os.environ.get("ENTITLEMENTS_FILE", "entitlements.json")
with open(path) as f:
    entitled = json.load(f)
payload = event.get("payload") or {}
user = (payload.get("metadata") or {}).get("user_id") or event["headers"].get("x-team") or "*"
model = event.get("model") or ""
allowed = entitled.get(user, entitled.get("*", []))
if not any(fnmatch.fnmatch(model, pattern) for pattern in allowed):
    print(json.dumps({"block": {
        "status": 403,
        "type": "permission_error",
        "message": f"{user} has no entitlement to {model}",
    }}))
