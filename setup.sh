#!/usr/bin/env bash
# The whole set-up: system packages, Python packages at exact pins (requirements.txt, torch first)
# and WebArena's task configs (data only).
set -euo pipefail
cd "$(dirname "$0")"

# System packages: Chromium (the WebArena env drives it; no browser is ever downloaded) and a Java
# runtime (the ScienceWorld simulator is a JVM program).
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v java >/dev/null 2>&1 || missing+=(openjdk-17-jre-headless)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}"
  else
    echo "setup.sh: please install ${missing[*]} (sudo apt-get install -y ${missing[*]})" >&2
  fi
fi

python -m pip install -r requirements.txt
# WebArena's 812 task configs. --no-deps: only its JSON is read, and its exact pins clash with ours.
python -m pip install --no-deps webarena-verified==1.2.3
