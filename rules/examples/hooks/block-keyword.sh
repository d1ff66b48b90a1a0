#!/bin/sh
# Blocks any request whose event (the payload included) contains the keyword $1:
# exit 2 blocks, and what goes to stderr is the message the client gets.
if grep -qiF -- "$1"; then
  echo "requests about $1 are not allowed through this proxy" >&2
  exit 2
fi
exit 0
