# There (a lent GPU machine, the project not installed), sourced at a command's start: the carried
# wheels (.whl) into /tmp/site, the checkout importable as loraplex (after them), the tests' tokenizer
# folder, $OUT made. Here, benchmarks/fetch_gpu_wheels.sh makes what it reads.
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || return 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# the project is not installed there: processes (the servers' python -P too) import loraplex from here
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
[ -d .whl/smollm2-tokenizer ] && export LORAPLEX_TEST_TOKENIZER_DIR=$PWD/.whl/smollm2-tokenizer
export OUT=${OUT:-.out}
mkdir -p "$OUT"
