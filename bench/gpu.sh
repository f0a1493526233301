#!/usr/bin/env bash
# The benchmark suites, run by name on the GPU machine (one H200). Each suite fits in one 10-minute command and
# leaves its logs under $OUT (at most 8 files come back from there: no suite writes more). bench/RESULTS.md is the
# dated record of what they measured; this script only says how.
#
#   bash bench/gpu.sh tests   [PYTEST ARGS]  the `cuda` tests (python3 -m pytest -m cuda -q, without pyproject's addopts:
#                                            the GPU machine has no pytest-xdist), one pytest a file, four at a
#                                            time, test_quant_kernels.py in three parts and test_cache_auto.py
#                                            alone at the end (one process with the arguments given instead, if any)
#   bash bench/gpu.sh rows    [BENCH FLAGS]  the reference GGUF's `moestream bench` rows, pp4096 and tg64, -r 2: all
#                                            on the GPU at ubatch 512 / 2048 / 4096, then --cpu-moe with
#                                            --moe-cache-mib 0 / 8000 / 16000 / 24000 at the same ubatches
#   bash bench/gpu.sh decode  [BENCH FLAGS]  the decode row at 16000 MiB, ubatch 2048 (zero-copy decode; its A/B
#                                            against --no-zero-copy-decode: bench/RESULTS.md, removed at stop 47)
#   bash bench/gpu.sh server  [SERVE FLAGS]  `moestream serve` on the reference GGUF (--cpu-moe, 16000 MiB, -np 16)
#                                            under 1 / 2 / 4 / 8 / 16 streaming clients (bench/serve_load.py), then
#                                            a one-minute soak of it (bench/soak.py --url)
#   bash bench/gpu.sh pacing  [FLAG SETS]    the server of `server` under 4 / 8 / 16 clients, no soak, once per
#                                            quoted flag set ('' for the defaults), e.g. pacing '' '--prefill-layers
#                                            0' '--scheduler-delay-factor 1': its prompt pacing options side by side
#   bash bench/gpu.sh parallel [BENCH FLAGS] `moestream bench --parallel 1,2,4,8,16 -npp 512 -ntg 64`: all on the
#                                            GPU, --cpu-moe at 8000 / 16000 MiB, and Q4_K_M at 4000 MiB
#   bash bench/gpu.sh profile                a cached prompt's copy and compute streams at ubatch 4096 / 2048
#                                            (bench/prompt_timeline.py) and a decode step's host/GPU split, all
#                                            on the GPU and at 16000 / 24000 MiB (bench/decode_steps.py)
#   bash bench/gpu.sh trace                  a routing trace of one prompt and its decode at 16000 MiB (`moestream
#                                            generate --trace`), replayed over caches and policies (`moestream replay`)
#   bash bench/gpu.sh quant   [BENCH FLAGS]  the reference through `moestream quantize` to Q4_K_M and Q8_0 (once per
#                                            machine, /tmp/ref-q4km.gguf and /tmp/ref-q8.gguf), then their rows: Q4_K_M
#                                            all on the GPU, --cpu-moe with no cache and with 4000 MiB; Q8_0 --cpu-moe
#   bash bench/gpu.sh qdecode                the quantized decode kernel's variants: bench/quant_kernels.py (values,
#                                            runs), then the Q4_K_M rows all on the GPU, --cpu-moe with 4000 MiB and
#                                            with no cache, at ubatch 2048 (the default kernel; the whole-model rows of
#                                            MOESTREAM_DECODE_QUANT=values and subblocks: bench/RESULTS.md, 2026-12-01)
#   bash bench/gpu.sh kld                    perplexity's KL divergence of the Q4_K_M and Q8_0 files against the BF16
#                                            reference, and of a cache state against all on the GPU (0 exactly)
#   bash bench/gpu.sh next    [BENCH FLAGS]  the Qwen3-Next reference (make_reference_next_gguf.py, 12 layers, BF16,
#                                            40.8 GB, and its Q4_K_M by moestream quantize, 12.4 GB; once per machine,
#                                            after removing the Qwen3-30B files: both pairs do not fit the 64 GB disk),
#                                            then issue 17's rows: BF16 all on the GPU and --cpu-moe at 0 / 8000 /
#                                            16000 MiB (and 16000 with --prefetch-first-all, --no-prefetch); Q4_K_M
#                                            all on the GPU, at 4000 MiB (ubatch 2048 / 4096) and with no cache;
#                                            then a Q4_K_M decode step's kernels (bench/step_profile.py)
#   bash bench/gpu.sh arrays                 the Next Q4_K_M prompts at 4000 MiB (ubatch 4096 / 2048, -n 0 -r 3), the
#                                            prompt timeline at ubatch 4096 (the files of `next`) and bench/copy_order.py
#                                            (the copy-call A/B, MOESTREAM_HOST_ARRAYS=copy: bench/RESULTS.md, stop 38)
#   bash bench/gpu.sh deepseek STAGE [FLAGS] DeepSeek-V3's reference beside llama.cpp b11549 (issue 52), a stage a
#                                            command: prep (llama.cpp built from .carry/llamacpp in the background,
#                                            make_reference_deepseek_gguf.py 4 layers --experts q4_0 written), quant
#                                            (its Q4_K_M by moestream quantize, the q4_0 file deleted), then gpu, cache
#                                            (--cpu-moe, no cache and DS_CACHE MiB, default 5200), par (1 / 4 / 8
#                                            streams at DS_CACHE): llama-batched-bench and moestream bench alternating
#   bash bench/gpu.sh gptoss STAGE [FLAGS]   gpt-oss-120b's reference beside llama.cpp b11549 (issue 53), a stage a
#                                            command: prep (llama.cpp built from .carry/llamacpp in the background,
#                                            make_reference_gptoss_gguf.py 12 layers written: MXFP4 experts, 23.3 GB),
#                                            gpu, cache (--cpu-moe, no cache and GO_CACHE MiB, default 4900: a quarter
#                                            of the experts, three whole layers), par (1 / 4 / 8 streams at GO_CACHE)
#   bash bench/gpu.sh flashnext STAGE [FLAGS] Qwen3.8-Flash-Next's reference beside llama.cpp b11549 (issue 50), a
#                                            stage a command: prep (llama.cpp built in the background,
#                                            make_reference_qwen4exp_gguf.py 8 layers: BF16, 46.8 GB), quant (its
#                                            Q4_K_M by moestream quantize), iq1 (an imatrix of 8 chunks of 512 random
#                                            ids, then IQ1_M; the BF16 file deleted), rows TYPE (q4km or iq1m: pp4096
#                                            at ubatch 512 / 2048 / 8192 and tg64, all on the GPU and --cpu-moe with
#                                            no cache), cache TYPE (FN_CACHE MiB, default a third of that file's
#                                            experts), seed TYPE
#                                            (a warm prompt's first chunk seeded from the last prompt, and
#                                            --no-prefetch-seed, at ubatch 2048 / 8192)
#   bash bench/gpu.sh mtp STAGE [FLAGS]      MTP on the Qwen3-Next reference's Q4_K_M (issue 51; the files of `next`)
#                                            with a random head beside it, a stage a command: prep (next_files, then
#                                            `python bench/make_mtp_head.py $NQ /tmp/next-head.gguf --type Q4_K_M`:
#                                            the head llama.cpp's -md reads, random weights at the target's shapes),
#                                            oracle (pp512 / tg128, --spec-oracle 0.8 at n-max 0,1,2,3: all on the GPU,
#                                            --cpu-moe with 4000 MiB and with no cache), real (the head's own drafts,
#                                            n-max 0,2 at 4000 MiB; then --parallel 4 at 4000 MiB without MTP, with
#                                            the head's drafts at n-max 2, and n-max 0,2 with --spec-oracle 0.8: each
#                                            stream its own continuation's oracle, MTP off in the same process),
#                                            lcbuild (llama.cpp b11549 and its llama-server, where its MTP runs),
#                                            llama (llama-server on the same files with the head's drafts and without)
#   bash bench/gpu.sh all     [BENCH FLAGS]  tests, rows and decode: the run bench/RESULTS.md's rows come from
#
# Flags after the suite name go to every `moestream bench` command of rows, decode and all (for example
# `bash bench/gpu.sh rows --cache-policy lru`), to pytest in tests and to `moestream serve` in server.
# Every bench row prints the hash of its greedy tokens; the numerics contract says it is the same in every row of
# one decode path: 098942c8f2c73325 with the defaults, all on the GPU and at every cache size (RESULTS.md).
#
# Setup, once per checkout: the GPU machine lacks the server's packages and gguf, and the reference model's writer
# lives outside the repository, so both travel in .carry/ (ignored by git, carried to the machine):
#   mkdir -p .carry && cp ../shared/wheels-gpu/*.whl ../shared/bench/make_reference_*gguf.py .carry/
#   cp -r ../shared/llamacpp .carry/            (llama.cpp b11549's source, for the suites beside llama.cpp: deepseek)
#   echo /.carry/ >> "$(git rev-parse --git-common-dir)/info/exclude"
# Then run a suite on the GPU machine from the repository root, with .carry/ carried along (the device tool's
# `carry: [".carry"]`), e.g. the command `bash bench/gpu.sh all`. The script installs the wheels into /tmp/site and
# imports this checkout's package in place (PYTHONPATH=/tmp/site:$PWD, nothing installed). The reference GGUF
# (Qwen3-30B-A3B shapes, 24 layers, BF16, 31.2 GB, no tokenizer) is written once per machine to /tmp/ref.gguf, in
# about 2 minutes; later suites on the same warm machine reuse it. (REF=PATH and SITE=DIR move those two.)
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SUITE=${1:-}; shift $(( $# > 0 ))
EXTRA=("$@")                     # the flags after the suite name
REF=${REF:-/tmp/ref.gguf}; SITE=${SITE:-/tmp/site}
Q4=${REF%.gguf}-q4km.gguf; Q8=${REF%.gguf}-q8.gguf
N=/tmp/next.gguf; NQ=/tmp/next-q4km.gguf          # the Qwen3-Next reference and its Q4_K_M (next, arrays, mtp)

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2; }
case "$SUITE" in
tests|rows|decode|server|pacing|parallel|profile|trace|quant|qdecode|kld|next|arrays|deepseek|gptoss|flashnext|mtp|all) ;;
*) usage ;;
esac
if ! ls .carry/*.whl .carry/make_reference_gguf.py .carry/make_reference_next_gguf.py > /dev/null 2>&1; then
  echo "error: .carry/ lacks the wheels or make_reference_gguf.py: see the setup notes at the top of $0" >&2; exit 2
fi
if [ ! -f "$SITE/.installed" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .carry/*.whl > /dev/null \
    && touch "$SITE/.installed" || { echo "error: installing .carry/*.whl failed" >&2; exit 2; }
fi
export PYTHONPATH=$SITE:$PWD

reference() {      # the reference GGUF, once per machine; then a pause of $1 s while the host writes it back
  if [ ! -f $REF ]; then
    local t=$SECONDS
    timeout 300 python3 .carry/make_reference_gguf.py $REF.part 24 2>&1 | tail -1 && mv $REF.part $REF
    echo "reference GGUF written in $((SECONDS - t)) s"
  fi
  sync; sleep "${1:-0}"
}
quantized() {      # the reference's Q4_K_M and Q8_0 (or the files given), once per machine (moestream quantize)
  reference 0
  local file type
  for file in ${@:-$Q4:Q4_K_M $Q8:Q8_0}; do
    type=${file#*:}; file=${file%%:*}
    if [ ! -f $file ]; then
      local t=$SECONDS
      timeout 420 python3 -m moestream quantize $REF $file $type 2>&1 | tail -3
      echo "$type written in $((SECONDS - t)) s: $(stat -c %s $file 2> /dev/null) bytes"
    fi
  done
  sync
}
bench() {          # bench LOG TIMEOUT ARGS...: one `moestream bench` command (and the suite's flags), appended to LOG
  local log=$1 limit=$2; shift 2
  echo "## moestream bench $* ${EXTRA[*]+${EXTRA[*]}}" | tee -a "$OUT/$log"
  timeout "$limit" python3 -m moestream bench "$@" ${EXTRA[@]+"${EXTRA[@]}"} 2>&1 | tee -a "$OUT/$log"
}
healthy() {        # wait up to $1 s for the server on port 8080 to answer /health with 200
  local end=$((SECONDS + $1))
  while [ $SECONDS -lt $end ]; do
    python3 -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:8080/health').status_code != 200)" \
      2> /dev/null && return 0
    sleep 2
  done
  return 1
}

tests() {
  if [ $# -gt 0 ]; then
    timeout 420 python3 -m pytest -o addopts="" -m cuda -q -rf --tb=short "$@" > "$OUT/cuda_tests.log" 2>&1
    echo "cuda tests: exit $?"; tail -25 "$OUT/cuda_tests.log"; return
  fi
  # Four processes at a time (one GPU holds them; Triton's compiles use the cores): each file with cuda tests,
  # tests/test_quant_kernels.py's in three parts (over 540 s in one process); test_cache_auto.py alone after them
  # (it fills the GPU, so the others ran out of memory beside it: stop 49).
  local dir=/tmp/cuda_tests
  rm -rf $dir; mkdir -p $dir
  export CUDA_TESTS_END=$(( $(date +%s) + 520 )) CUDA_TESTS_DIR=$dir
  python3 -m pytest -o addopts="" -m cuda --co -q -p no:cacheprovider tests/test_quant_kernels.py 2> /dev/null \
    | grep "::" | split -n r/3 -d - $dir/quant_kernels_part
  one() {          # one pytest of the node ids in file $1 (a part's list) or of test file $1; its log in $dir
    local name=$(basename $1 .py) left=$((CUDA_TESTS_END - $(date +%s))) args=$1
    case $1 in */quant_kernels_part*) args=$(cat $1) ;; esac
    [ $left -gt 10 ] || { echo "$name: not run (out of time)"; return; }
    timeout $left python3 -m pytest -o addopts="" -m cuda -q -rf --tb=short -p no:cacheprovider $args \
      > $CUDA_TESTS_DIR/$name.log 2>&1
    echo "$name: exit $? $(tail -1 $CUDA_TESTS_DIR/$name.log)"
    { flock 1; echo "## $name"; cat $CUDA_TESTS_DIR/$name.log; } >> "$OUT/cuda_tests.log"   # (as it ends: a call
  }                                                      # cut off at its limit keeps these; one file's log at a time)
  export -f one
  export OUT; : > "$OUT/cuda_tests.log"
  { ls $dir/quant_kernels_part*; grep -l "mark.cuda" tests/test_*.py | grep -v "test_quant_kernels\|test_cache_auto"; } \
    | xargs -P 4 -I{} bash -c 'one {}'
  one tests/test_cache_auto.py
  grep -hE "^FAILED|^ERROR" $dir/*.log | head -40
}

rows() {           # (-b 4096: a 4096-token prompt is one ubatch at -ub 4096)
  reference 15     # (the all-GPU ubatch-512 row is host-bound: it measured 25% less while the file was written back)
  local B="-m $REF -p 4096 -n 64 -ub 512,2048,4096 -b 4096 -r 2"
  bench bench_gpu.md 90 $B
  bench bench_cache.md 170 $B --cpu-moe --moe-cache-mib 0,8000,16000,24000
}

decode() {         # tg64 after pp4096 prompts, as the cache rows of rows measure it
  reference 5
  local B="-m $REF -p 4096 -n 64 -ub 2048 -b 4096 -r 2 --cpu-moe --moe-cache-mib 16000"
  bench bench_decode.md 90 $B
}

server() {
  reference 15
  python3 -m moestream serve -m $REF --cpu-moe --moe-cache-mib 16000 -np 16 -c 1024 --port 8080 "$@" \
    > "$OUT/serve.log" 2>&1 &
  local pid=$!
  if healthy 240; then
    timeout 150 python3 bench/serve_load.py --url http://127.0.0.1:8080 --clients 1,2,4,8,16 -p 512 -n 64 -r 2 2>&1 \
      | tee "$OUT/serve_load.md"
    timeout 110 python3 bench/soak.py --url http://127.0.0.1:8080 --minutes 1.2 --clients 12 2>&1 | tail -25 \
      | tee "$OUT/soak.md"
    python3 -c "import httpx; print(httpx.get('http://127.0.0.1:8080/metrics').text)" 2> /dev/null \
      | grep "^moestream_" | grep -v "_bucket\|_created" | tee "$OUT/serve_metrics.txt"
  else
    echo "the server did not come up in 240 s:"; tail -20 "$OUT/serve.log"
  fi
  kill $pid; wait $pid
}

pacing() {         # each flag set's server in turn, its serve_load table, its prompt and decode batches' sizes
  reference 15
  local flags
  for flags in "$@"; do
    python3 -m moestream serve -m $REF --cpu-moe --moe-cache-mib 16000 -np 16 -c 1024 --port 8080 $flags \
      > "$OUT/serve.log" 2>&1 &
    local pid=$!
    echo "## moestream serve ... $flags" | tee -a "$OUT/pacing.md"
    if healthy 150; then
      timeout 120 python3 bench/serve_load.py --url http://127.0.0.1:8080 --clients 4,8,16 -p 512 -n 64 -r 2 2>&1 \
        | tee -a "$OUT/pacing.md"
      python3 -c "import httpx; print(httpx.get('http://127.0.0.1:8080/metrics').text)" 2> /dev/null \
        | grep "^moestream_\(prompt\|decode\)_batch_size_\(sum\|count\)" | tee -a "$OUT/pacing.md"
    else
      echo "the server did not come up in 150 s:"; tail -20 "$OUT/serve.log"
    fi
    kill $pid; wait $pid
  done
}

parallel() {       # several sequences decoded together (llama-batched-bench's shape), fresh prompts each
  quantized $Q4:Q4_K_M
  local P="--parallel 1,2,4,8,16 -npp 512 -ntg 64 -r 1 -ub 512"
  bench parallel.md 100 -m $REF $P
  bench parallel.md 200 -m $REF $P --cpu-moe --moe-cache-mib 16000,8000
  bench parallel.md 120 -m $Q4 $P --cpu-moe --moe-cache-mib 4000
}

profile() {
  reference 5
  timeout 160 python3 bench/prompt_timeline.py $REF "$OUT" -ub 4096,2048 --cprofile 2>&1 | grep -v "^USDT\|UserWarning" \
    | tee "$OUT/timeline.txt"
  timeout 100 python3 bench/decode_steps.py $REF 2>&1 | tee "$OUT/decode_steps.md"
  timeout 130 python3 bench/decode_steps.py $REF --cpu-moe --moe-cache-mib 16000,24000 --cprofile 2>&1 \
    | tee -a "$OUT/decode_steps.md"
}

quant() {
  quantized
  local B="-p 4096 -n 64 -b 4096 -r 2"
  bench bench_q4km.md 120 -m $Q4 $B -ub 512,2048,4096 --cpu-moe
  bench bench_q4km.md 120 -m $Q4 $B -ub 2048,4096 --cpu-moe --moe-cache-mib 4000
  bench bench_q4km.md 90 -m $Q4 $B -ub 2048
  bench bench_q8.md 90 -m $Q8 $B -ub 4096 --cpu-moe
}

qdecode() {
  timeout 300 python3 bench/quant_kernels.py 2>&1 | tee "$OUT/quant_kernels.md"
  quantized $Q4:Q4_K_M
  local B="-m $Q4 -p 4096 -n 64 -b 4096 -r 2 -ub 2048"
  bench bench_qdecode.md 60 $B
  bench bench_qdecode.md 60 $B --cpu-moe --moe-cache-mib 4000
  bench bench_qdecode.md 60 $B --cpu-moe
}

kld() {            # 16 chunks of 512 random ids (the reference has no tokenizer), ubatch 512
  quantized
  python3 -c "import random; r = random.Random(2); print(','.join(str(r.randrange(151936)) for _ in range(8192)))" \
    > /tmp/kld_ids.txt
  rm -f /tmp/base.kld /tmp/q4.kld          # perplexity refuses to overwrite a base file
  local P="python3 -m moestream perplexity --token-ids -c 512 -b 512 -ub 512"
  { echo "## base: $REF"; timeout 120 $P -m $REF -f /tmp/kld_ids.txt --kl-divergence-base /tmp/base.kld 2>&1 | tail -2
    for m in $Q8 $Q4; do echo "## $m"; timeout 120 $P -m $m --kl-divergence-base /tmp/base.kld --kl-divergence 2>&1 | grep -v "Δp" | tail -14; done
    echo "## $Q4 base, then --cpu-moe --moe-cache-mib 4000 against it (the numerics contract: KLD 0)"
    timeout 120 $P -m $Q4 -f /tmp/kld_ids.txt --kl-divergence-base /tmp/q4.kld 2>&1 | tail -1
    timeout 120 $P -m $Q4 --kl-divergence-base /tmp/q4.kld --kl-divergence --cpu-moe --moe-cache-mib 4000 2>&1 | grep -v "Δp" | tail -14
  } | tee "$OUT/kld.md"
}

next_files() {     # the Qwen3-Next reference and its Q4_K_M, once per machine
  local t
  rm -f $REF $Q4 $Q8                 # (40.8 + 12.4 GB beside 31.2 + 9.5 + 16.6 would not fit)
  if [ ! -f $N ]; then
    t=$SECONDS; timeout 240 python3 .carry/make_reference_next_gguf.py $N.part 12 2>&1 | tail -1 && mv $N.part $N
    echo "Qwen3-Next reference written in $((SECONDS - t)) s"
  fi
  if [ ! -f $NQ ]; then
    t=$SECONDS; timeout 300 python3 -m moestream quantize $N $NQ.part Q4_K_M 2>&1 | tail -1 && mv $NQ.part $NQ
    echo "Q4_K_M written in $((SECONDS - t)) s: $(stat -c %s $NQ 2> /dev/null) bytes"
  fi
  sync
}
next() {           # issue 17's rows on the Qwen3-Next reference
  next_files
  local B="-p 4096 -n 64 -b 4096 -r 2 -ub 2048"
  bench next_bf16.md 90 -m $N $B
  bench next_bf16.md 160 -m $N $B --cpu-moe --moe-cache-mib 0,8000,16000
  bench next_bf16.md 80 -m $N $B --cpu-moe --moe-cache-mib 16000 --prefetch-first-all
  bench next_bf16.md 80 -m $N $B --cpu-moe --moe-cache-mib 16000 --no-prefetch
  bench next_q4km.md 60 -m $NQ $B
  bench next_q4km.md 90 -m $NQ -p 4096 -n 64 -b 4096 -r 2 -ub 2048,4096 --cpu-moe --moe-cache-mib 4000
  bench next_q4km.md 70 -m $NQ $B --cpu-moe
  timeout 150 python3 bench/step_profile.py $NQ -n 16 --top 40 2>&1 | grep -v Warning > "$OUT/step_profile.md"
}

arrays() {         # how small host arrays reach the device, on Next's sweeping prompts (kernels/host_arrays.py)
  next_files
  bench next_arrays.md 70 -m $NQ -p 4096 -n 0 -b 4096 -r 3 -ub 4096,2048 --cpu-moe --moe-cache-mib 4000
  timeout 90 python3 bench/prompt_timeline.py $NQ /tmp/timeline_arrays --mib 4000 -ub 4096 2>&1 \
    | grep -v "^USDT\|UserWarning" | tee "$OUT/next_arrays_timeline.txt"
  timeout 60 python3 bench/copy_order.py 2>&1 | tee "$OUT/copy_order.txt"
}

mtp() {            # issue 51's rows: speculation with a random MTP head (bench/make_mtp_head.py) beside Next's Q4_K_M
  local H=/tmp/next-head.gguf
  local S="-m $NQ -md $H --spec-type draft-mtp" B="-p 512 -n 128 -ub 2048 -r 2"
  local P="--parallel 4 -npp 512 -ntg 128 -ub 2048 -r 2 --cpu-moe --moe-cache-mib 4000"
  case "${1:-}" in
  oracle|real|llama) [ -f $H ] || { echo "mtp: no $H on this machine: run the prep stage first" >&2; return 2; } ;;
  esac
  case "${1:-}" in
  prep)   next_files
          if [ ! -f $H ]; then
            local t=$SECONDS
            timeout 240 python3 bench/make_mtp_head.py $NQ $H --type Q4_K_M 2>&1 | tail -1
            echo "head written in $((SECONDS - t)) s"
          fi ;;
  oracle) bench mtp_oracle.md 150 $S $B --spec-draft-n-max 0,1,2,3 --spec-oracle 0.8
          bench mtp_oracle.md 200 $S $B --spec-draft-n-max 0,1,2,3 --spec-oracle 0.8 --cpu-moe --moe-cache-mib 4000
          bench mtp_oracle.md 200 $S $B --spec-draft-n-max 0,1,2,3 --spec-oracle 0.8 --cpu-moe ;;
  real)   bench mtp_real.md 150 $S $B --spec-draft-n-max 0,2 --cpu-moe --moe-cache-mib 4000
          bench mtp_real.md 130 -m $NQ $P
          bench mtp_real.md 160 $S $P --spec-draft-n-max 2
          bench mtp_real.md 150 $S $P --spec-draft-n-max 0,2 --spec-oracle 0.8 ;;
  lcbuild) bash .carry/llamacpp/build.sh > "$OUT/lcu_build.log" 2>&1; tail -1 "$OUT/lcu_build.log"
          if [ ! -x /tmp/lcu/bin/llama-server ]; then      # (build.sh leaves the server out: b11549's MTP runs in it)
            cmake -S /tmp/lcu-src -B /tmp/lcu -DLLAMA_BUILD_SERVER=ON > /tmp/lcu-cmake2.log 2>&1 \
              && cmake --build /tmp/lcu --target llama-server -j "$(nproc)" > /tmp/lcu-build2.log 2>&1
            ls -la /tmp/lcu/bin/llama-server || tail -20 /tmp/lcu-build2.log
          fi ;;
  llama)  # llama-server on the same files, its head's drafts (acceptance near 0) against none: one 512-id prompt,
          # 128 tokens, greedy, twice each (the second's timings), --cpu-moe's match: -ncmoe 12 with 4000 MiB
          local spec
          export LD_LIBRARY_PATH=/tmp/lcu/bin
          for spec in "" "-md $H --spec-type draft-mtp --spec-draft-n-max 2"; do
            echo "## llama-server -m $NQ $spec -ngl 99 -ncmoe 12 --moe-cache-mib 4000" | tee -a "$OUT/mtp_llama.md"
            /tmp/lcu/bin/llama-server -m $NQ $spec -ngl 99 -ncmoe 12 --moe-cache-mib 4000 -fa on -c 4096 -np 1 \
              --port 8081 > "$OUT/llama_server.log" 2>&1 &
            local pid=$!
            if timeout 200 python3 -c "
import httpx, time
while True:
    try:
        if httpx.get('http://127.0.0.1:8081/health').status_code == 200: break
    except httpx.HTTPError: pass
    time.sleep(2)"; then
              timeout 200 python3 - <<'PY' 2>&1 | tee -a "$OUT/mtp_llama.md"
import httpx, random
r = random.Random(4)
ids = [r.randrange(151936) for _ in range(512)]
for i in range(2):
    j = httpx.post("http://127.0.0.1:8081/completion", timeout=180,
                   json={"prompt": ids, "n_predict": 128, "temperature": 0, "ignore_eos": True, "cache_prompt": False}).json()
    t = j.get("timings", {})
    print(f"run {i}: prompt {t.get('prompt_per_second', 0):.1f} t/s, decode {t.get('predicted_per_second', 0):.2f} t/s, "
          f"drafted {t.get('draft_n')}, accepted {t.get('draft_n_accepted')}")
PY
            else
              echo "llama-server did not come up:"; tail -15 "$OUT/llama_server.log"
            fi
            kill $pid; wait $pid 2> /dev/null
          done ;;
  *)      echo "mtp takes a stage: prep, oracle, real, lcbuild or llama" >&2; return 2 ;;
  esac
}

trace() {          # one prompt of 4096 random ids (the same every run), at ubatch 2048, then 64 tokens
  reference 5
  python3 -c "import random; r = random.Random(1); print(','.join(str(r.randrange(151936)) for _ in range(4096)))" \
    > /tmp/trace_prompt.txt
  timeout 120 python3 -m moestream generate -m $REF -f /tmp/trace_prompt.txt -n 64 --ignore-eos -c 4160 -b 4096 \
    -ub 2048 --cpu-moe --moe-cache-mib 16000 --trace "$OUT/ref_trace.npz" --hash-only --timings 2>&1 \
    | tee "$OUT/trace.md"
  for v in "" "--policy lfru --prefetch --zero-copy"; do
    echo "## moestream replay ref_trace.npz --moe-cache-mib 8000,16000,24000 $v"
    timeout 120 python3 -m moestream replay "$OUT/ref_trace.npz" --moe-cache-mib 8000,16000,24000 $v 2>&1
  done | tee -a "$OUT/trace.md"
}

deepseek() {       # issue 52's rows: llama.cpp (the third of three runs in one process) and moestream on one file
  local DS=/tmp/ds.gguf DSQ=/tmp/ds-q4km.gguf C=${DS_CACHE:-5200} L=/tmp/lcu/bin/llama-batched-bench
  export LD_LIBRARY_PATH=/tmp/lcu/bin
  lc() { echo "## llama-batched-bench $*" | tee -a "$OUT/ds_rows.md"
         timeout 240 $L -m $DSQ -fa on -t 16 -lm none "$@" 2>&1 | grep -E "^\|" | tee -a "$OUT/ds_rows.md"; }
  ms() { bench ds_rows.md 300 -m $DSQ "$@"; }
  case "${1:-}" in
  prep)  (bash .carry/llamacpp/build.sh > "$OUT/lcu_build.log" 2>&1) &
         [ -f $DS ] || [ -f $DSQ ] || { timeout 400 python3 .carry/make_reference_deepseek_gguf.py $DS.part 4 --experts q4_0 \
           2>&1 | tail -1 && mv $DS.part $DS; }
         wait; tail -1 "$OUT/lcu_build.log" ;;
  quant) [ -f $DSQ ] || { timeout 560 python3 -m moestream quantize $DS $DSQ Q4_K_M --allow-requantize 2>&1 | tail -1
                          rm -f $DS; } ;;
  gpu)   lc -ngl 99 -c 8192 -b 4096 -ub 2048 -npp 4096 -ntg 64 -npl 1,1,1
         ms -p 4096 -n 64 -ub 2048,4096 -b 4096 -r 2
         lc -ngl 99 -c 8192 -b 4096 -ub 4096 -npp 4096 -ntg 64 -npl 1,1,1 ;;
  cache) lc -ngl 99 -ncmoe 4 --moe-cache-mib 0 -c 8192 -b 4096 -ub 2048 -npp 4096 -ntg 64 -npl 1,1,1
         ms -p 4096 -n 64 -ub 2048,4096 -b 4096 -r 2 --cpu-moe --moe-cache-mib 0,$C
         lc -ngl 99 -ncmoe 4 --moe-cache-mib $C -c 8192 -b 4096 -ub 2048 -npp 4096 -ntg 64 -npl 1,1,1 ;;
  par)   lc -ngl 99 -ncmoe 4 --moe-cache-mib $C -c 20000 -b 4096 -ub 512 -npp 512 -ntg 64 -npl 1,4,8
         ms --parallel 1,4,8 -npp 512 -ntg 64 --cpu-moe --moe-cache-mib $C ;;
  *)     echo "deepseek takes a stage: prep, quant, gpu, cache or par" >&2; return 2 ;;
  esac
}

gptoss() {         # issue 53's rows: llama.cpp (the third of three runs in one process) and moestream on one file
  local G=/tmp/gptoss.gguf C=${GO_CACHE:-4900} L=/tmp/lcu/bin/llama-batched-bench
  export LD_LIBRARY_PATH=/tmp/lcu/bin
  lc() { echo "## llama-batched-bench $*" | tee -a "$OUT/gptoss_rows.md"
         timeout 200 $L -m $G -fa on -t 16 -lm none "$@" 2>&1 | grep -E "^\|" | tee -a "$OUT/gptoss_rows.md"; }
  ms() { bench gptoss_rows.md 240 -m $G "$@"; }
  local P="-c 8192 -b 4096 -ub 2048 -npp 4096 -ntg 64 -npl 1,1,1"
  case "${1:-}" in
  prep)  (bash .carry/llamacpp/build.sh > "$OUT/lcu_build.log" 2>&1) &
         [ -f $G ] || { timeout 400 python3 .carry/make_reference_gptoss_gguf.py $G.part 12 2>&1 | tail -1 && mv $G.part $G; }
         wait; tail -1 "$OUT/lcu_build.log" ;;
  gpu)   lc -ngl 99 $P
         ms -p 4096 -n 64 -ub 2048,4096 -b 4096 -r 2
         lc -ngl 99 ${P/-ub 2048/-ub 4096} ;;
  cache) lc -ngl 99 -ncmoe 12 --moe-cache-mib 0 $P
         ms -p 4096 -n 64 -ub 2048,4096 -b 4096 -r 2 --cpu-moe --moe-cache-mib 0,$C
         lc -ngl 99 -ncmoe 12 --moe-cache-mib $C $P ;;
  par)   lc -ngl 99 -ncmoe 12 --moe-cache-mib $C -c 20000 -b 4096 -ub 512 -npp 512 -ntg 64 -npl 1,4,8
         ms --parallel 1,4,8 -npp 512 -ntg 64 --cpu-moe --moe-cache-mib $C ;;
  *)     echo "gptoss takes a stage: prep, gpu, cache or par" >&2; return 2 ;;
  esac
}

flashnext() {      # issue 50's rows: llama.cpp (the third of three runs in one process) and moestream on one file
  local F=/tmp/fn.gguf T=${2:-q4km} L=/tmp/lcu/bin/llama-batched-bench
  local M=/tmp/fn-$T.gguf C=${FN_CACHE:-$([ "$T" = iq1m ] && echo 2100 || echo 3800)}
  export LD_LIBRARY_PATH=/tmp/lcu/bin
  lc() { echo "## llama-batched-bench $*" | tee -a "$OUT/fn_$T.md"
         timeout 200 $L -m $M -fa on -t 16 -lm none "$@" 2>&1 | grep -E "^\|" | tee -a "$OUT/fn_$T.md"; }
  ms() { bench fn_$T.md 240 -m $M "$@"; }
  local P="-c 8400 -b 8192 -npp 4096 -ntg 64 -npl 1,1,1"
  case "${1:-}" in
  prep)  (bash .carry/llamacpp/build.sh > "$OUT/lcu_build.log" 2>&1) &
         [ -f $F ] || { timeout 500 python3 .carry/make_reference_qwen4exp_gguf.py $F.part 8 2>&1 | tail -1 && mv $F.part $F; }
         wait; tail -1 "$OUT/lcu_build.log" ;;
  quant) [ -f /tmp/fn-q4km.gguf ] || { timeout 560 python3 -m moestream quantize $F /tmp/fn-q4km.gguf.part Q4_K_M 2>&1 \
           | tail -1 && mv /tmp/fn-q4km.gguf.part /tmp/fn-q4km.gguf; } ;;
  iq1)   python3 -c "import random; r = random.Random(3); print(','.join(str(r.randrange(248320)) for _ in range(4096)))" \
           > /tmp/fn_ids.txt
         [ -f /tmp/fn-imatrix.gguf ] || timeout 240 python3 -m moestream imatrix -m $F -f /tmp/fn_ids.txt --token-ids \
           -c 512 --chunks 8 -o /tmp/fn-imatrix.gguf 2>&1 | tail -2
         [ -f /tmp/fn-iq1m.gguf ] || { timeout 330 python3 -m moestream quantize $F /tmp/fn-iq1m.gguf.part IQ1_M \
           --imatrix /tmp/fn-imatrix.gguf 2>&1 | tail -1 && mv /tmp/fn-iq1m.gguf.part /tmp/fn-iq1m.gguf && rm -f $F; } ;;
  rows)  lc -ngl 99 -ub 2048 $P
         ms -p 4096 -n 64 -ub 512,2048,8192 -b 8192 -r 2
         lc -ngl 99 -ncmoe 8 --moe-cache-mib 0 -ub 2048 $P
         ms -p 4096 -n 64 -ub 512,2048,8192 -b 8192 -r 2 --cpu-moe --moe-cache-mib 0 ;;
  cache) ms -p 4096 -n 64 -ub 512,2048,8192 -b 8192 -r 2 --cpu-moe --moe-cache-mib $C
         lc -ngl 99 -ncmoe 8 --moe-cache-mib $C -ub 2048 $P
         lc -ngl 99 -ncmoe 8 --moe-cache-mib $C -ub 512 $P
         lc -ngl 99 -ncmoe 8 --moe-cache-mib $C -ub 8192 $P ;;
  seed)  ms -p 8192 -n 0 -ub 2048,8192 -b 8192 -r 3 --cpu-moe --moe-cache-mib $C
         ms -p 8192 -n 0 -ub 2048,8192 -b 8192 -r 3 --cpu-moe --moe-cache-mib $C --no-prefetch-seed ;;
  *)     echo "flashnext takes a stage: prep, quant, iq1, rows TYPE, cache TYPE or seed TYPE" >&2; return 2 ;;
  esac
}

{ nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv
  python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])"
  echo "commit $(git rev-parse --short HEAD 2> /dev/null || echo '?') suite $SUITE ${EXTRA[*]+${EXTRA[*]}}"; } \
  | tee "$OUT/gpu.txt"
case "$SUITE" in
tests) tests ${EXTRA[@]+"${EXTRA[@]}"} ;;
server) server ${EXTRA[@]+"${EXTRA[@]}"} ;;
pacing) pacing ${EXTRA[@]+"${EXTRA[@]}"} ;;
parallel) parallel ;;
deepseek|gptoss|mtp) stage=${EXTRA[0]:-}; EXTRA=("${EXTRA[@]:1}"); $SUITE "$stage" ;;
flashnext) stage=${EXTRA[0]:-}; type=q4km; case "${EXTRA[1]:-}" in q4km|iq1m) type=${EXTRA[1]}; EXTRA=("${EXTRA[@]:1}");; esac
           EXTRA=("${EXTRA[@]:1}"); flashnext "$stage" $type ;;   # (flags after the stage: bench's)
profile|trace|kld|qdecode) [ ${#EXTRA[@]} -eq 0 ] || echo "($SUITE takes no flags: ignored ${EXTRA[*]})"; $SUITE ;;
all) tests; rows; decode ;;
*) $SUITE ;;
esac
