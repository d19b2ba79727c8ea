#!/usr/bin/env bash
# Installs the Debian 12 packages qattn builds and tests with, when any is missing:
# CMake, Ninja, g++, and the libraries it uses from Debian (GoogleTest, CLI11,
# nlohmann_json, fmt), plus python3 for the CLI tests. Uses sudo when not root.
# CUDA is optional: with nvcc at /usr/local/cuda/bin (or on PATH) the kernels are
# built too; nothing here installs CUDA.
set -euo pipefail

packages=(cmake ninja-build g++ libgtest-dev libcli11-dev nlohmann-json3-dev libfmt-dev)
command -v python3 >/dev/null || packages+=(python3)

missing=()
for p in "${packages[@]}"; do
  [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup-deps: all Debian packages present"
  exit 0
fi

sudo=()
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || {
    echo "setup-deps: need root or sudo to install: ${missing[*]}" >&2
    exit 1
  }
  sudo=(sudo)
fi
echo "setup-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -q
"${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
