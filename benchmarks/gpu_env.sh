# There (a lent GPU machine, the project not installed), sourced at a command's start: the carried
# wheels into /tmp/site, the checkout importable as loraplex, the tests' tokenizer folder, $OUT made.
# Here, benchmarks/fetch_gpu_wheels.sh makes what it reads.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || return 1
export PYTHONPATH=/tmp/site:$PWD
export LORAPLEX_TEST_TOKENIZER_DIR=$PWD/.whl/smollm2-tokenizer
mkdir -p "${OUT:-.out}"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
