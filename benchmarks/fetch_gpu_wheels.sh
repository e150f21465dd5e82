#!/usr/bin/env bash
# Here (a machine with PyPI and the project's venv): what a lent GPU machine's image lacks, into .whl/
# (git-ignored): the wheels (Python 3.12, x86-64; the image has torch, CuPy, transformers, peft,
# grpcio 1.84.0, protobuf), SmolLM2's tokenizer as HF files (.whl/smollm2-tokenizer, for
# LORAPLEX_TEST_TOKENIZER_DIR) and the generated gRPC code (loraplex/v1, `make protos`).
# There, carry [".whl", "loraplex/v1"] and start the command with
#   source benchmarks/gpu_env.sh
# Usage: bash benchmarks/fetch_gpu_wheels.sh   (after `make setup`; PY=... for another interpreter)
set -euo pipefail
PY=$(realpath -s "$(command -v "${PY:-.venv/bin/python}")")  # absolute, links kept (a venv)
mkdir -p .whl
# pinned where the image's packages require it: grpcio's services at the image's 1.84.0; the rest as
# the project resolves them on Python 3.11 (xgrammar brings apache-tvm-ffi; pydantic its core)
WHEELS=(gguf==0.19.0 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic_core==2.50.5
        annotated-types==0.8.0 typing-inspection==0.4.5 starlette==1.10.0 uvicorn==0.55.0
        grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 redis==8.2.0 boto3==1.44.18
        botocore==1.44.18 s3transfer==0.19.3 jmespath==1.1.0 jsonschema==4.26.0
        jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 openai==3.63.0
        distro==1.9.0 jiter==0.19.0 sniffio==1.3.1)
PLATFORMS=()
for n in 17 24 27 28 31 34; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
# outside the checkout: its kernels/ would shadow Hugging Face's `kernels`, which transformers imports
(cd /tmp && "$PY" - "$OLDPWD/.whl/smollm2-tokenizer" <<'PYEOF'
import sys
from pathlib import Path

from loraplex.inference_server.model.checkpoint import default_model_path
from transformers import AutoTokenizer

gguf = Path(default_model_path())
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(sys.argv[1])
PYEOF
)
"$PY" protos/generate.py
du -sh .whl
