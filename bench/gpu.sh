#!/usr/bin/env bash
# One GPU-machine run (see .library/device): install what the image lacks, run the cuda tests and the benchmarks,
# logs under $OUT. Needs .carry/ (ignored, carried): ../shared/wheels-gpu/*.whl and ../shared/bench/make_reference_gguf.py
# (mkdir .carry; cp ../shared/wheels-gpu/*.whl ../shared/bench/make_reference_gguf.py .carry/; echo /.carry/ >> .git/info/exclude).
#
#   bash bench/gpu.sh smoke      cuda tests + a 4-layer synth model with the reference shapes
#   bash bench/gpu.sh ref        the 24-layer reference GGUF: load, pp4096/tg64 at ubatch 512/2048/4096, all on the
#                                GPU and --cpu-moe
#   bash bench/gpu.sh serve      the OpenAI server on the reference GGUF under 1 / 4 / 8 streaming clients
#   bash bench/gpu.sh rest       the prefetch rows the final run left out, and a routing trace with lookahead guesses
#   bash bench/gpu.sh probe      cuda tests; bench/probe.py: determinism across processes and cache settings, host
#                                time per layer, prompt lookahead, host decode graphs, a routing trace, a profile
#   bash bench/gpu.sh zc         zero-copy decode: cuda tests, the decode profile, decode on the reference model
#   bash bench/gpu.sh next       the cuda tests added after the last GPU run; --read-through and --shared-reads
#                                against the defaults (bench tg64, the server)
#   bash bench/gpu.sh steps      where a decode step's time goes (host vs GPU), and --read-through's hash
#   bash bench/gpu.sh prompt_host  cProfile of a cached prompt's host work (the gap to issue 4's bound)
#   bash bench/gpu.sh timeline   cuda tests; the copy and compute streams of a cached prompt (traces), its host calls
#   bash bench/gpu.sh fill       cuda tests; prompt timeline and bench at --lookahead-layers 1 / 2 / 3
#   bash bench/gpu.sh rows       issue 4's rows: defaults, --no-prefetch-seed, --no-prefetch, --lookahead-layers 1
#   bash bench/gpu.sh launchfill cuda tests; bench defaults against --lookahead-layers 1 (4 repetitions)
#   bash bench/gpu.sh final11    cuda tests; the defaults at ubatch 2048 / 4096, 16000 MiB
#   bash bench/gpu.sh decode     cuda tests; bench pp4096/tg64 over the caches, defaults and --read-through; server
#   bash bench/gpu.sh final      RESULTS.md's run: cuda tests, `moestream bench` all on the GPU and with caches of
#                                0 / 8000 / 16000 / 24000 MiB (hash column), the prefetch and decode switches
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
ms() { python3 -m moestream "$@"; }
REF=/tmp/ref.gguf
cuda_tests() { python3 -m pytest -m cuda tests/test_cuda.py -q "$@" 2>&1 | tail -15 | tee "$OUT/cuda_tests.log"; }
reference() {        # the reference GGUF (once per machine), then a pause while the host writes it back: $1 s
  [ -f $REF ] || python3 .carry/make_reference_gguf.py $REF 24 2>&1 | tail -1
  sync; sleep "${1:-0}"
}
cached_prompts() {   # $1 repetitions, $2 log: pp4096 + tg64 at ubatch 512/2048/4096, 16000 MiB, per variant $3...
  local r=$1 log=$2; shift 2
  for v in "$@"; do
    echo "## $v"; timeout 110 python3 -m moestream bench -m $REF -p 4096 -n 64 -ub 512,2048,4096 -b 4096 -r $r \
      --cpu-moe --moe-cache-mib 16000 $v 2>&1
  done | tee "$OUT/$log"
}
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])" | tee -a "$OUT/gpu.txt"

case "${1:-smoke}" in
smoke)
  cuda_tests -x
  M=synth:qwen3-30b-a3b:layers=4
  ms bench -m $M -p 4096 -n 64 -ub 512,4096 -b 4096 -r 2 -c 4096 2>&1 | tee "$OUT/smoke_gpu.md"
  ms bench -m $M -p 4096 -n 32 -ub 512,4096 -b 4096 -r 2 -c 4096 --cpu-moe 2>&1 | tee "$OUT/smoke_host.md"
  ms bench -m $M -p 0 -n 64 -r 2 -c 4096 --no-cuda-graphs 2>&1 | tee "$OUT/smoke_eager.md"
  ;;
ref)
  python3 bench/profile_decode.py synth:qwen3-30b-a3b:layers=4 2>&1 | grep "per decode step" | tee "$OUT/decode_steps.txt"
  [ -f $REF ] || { /usr/bin/time -v python3 .carry/make_reference_gguf.py $REF 24 2>&1 | grep -E "wrote|Elapsed|Maximum resident"; } | tee "$OUT/make_ref.log"
  ms bench -m $REF -p 4096 -n 64 -ub 512,2048,4096 -b 4096 -r 2 -v 2>&1 | tee "$OUT/ref_gpu.md"
  ms bench -m $REF -p 4096 -n 64 -ub 512,2048,4096 -b 4096 -r 2 -v --cpu-moe 2>&1 | tee "$OUT/ref_host.md"
  ;;
serve)
  reference
  ms serve -m $REF --cpu-moe --moe-cache-mib 16000 -np 8 -c 4096 --port 8080 > "$OUT/serve.log" 2>&1 &
  for i in $(seq 120); do python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:8080/health').status_code != 200)" 2>/dev/null && break; sleep 2; done
  python3 bench/serve_load.py --url http://127.0.0.1:8080 --clients 1,4,8 -p 512 -n 64 -r 2 2>&1 | tee "$OUT/serve_load.md"
  ;;
final)
  # RESULTS.md's run (one call, < 10 minutes): cuda tests, then `moestream bench` all on the GPU and with caches of
  # 0 / 8000 / 16000 / 24000 MiB (the hash column: one greedy decode per row, the same prompt in every process),
  # then the prefetch and decode switches at 16000 MiB. Each log goes into final.tar as soon as it is written.
  keep() { (cd "$OUT" && tar rf final.tar "$@" && rm -f "$@"); }
  cuda_tests -x; keep cuda_tests.log
  reference
  B="-m $REF -p 4096 -n 64 -b 4096 -r 2"
  timeout 90 python3 -m moestream bench $B -ub 512,2048,4096 > "$OUT/bench_gpu.md" 2>&1; cat "$OUT/bench_gpu.md"; keep bench_gpu.md
  timeout 170 python3 -m moestream bench $B -ub 512,2048,4096 --cpu-moe --moe-cache-mib 0,8000,16000,24000 --plot "$OUT/sweep.png" > "$OUT/bench_cache.md" 2>&1; cat "$OUT/bench_cache.md"; keep bench_cache.md
  for v in "--no-zero-copy-decode -ub 2048" "--no-zero-copy-decode --no-lookahead -ub 2048" "--no-prefetch-seed -ub 512,2048,4096" "--no-prefetch -ub 2048,4096"; do
    echo "## --cpu-moe --moe-cache-mib 16000 $v"; timeout 75 python3 -m moestream bench $B --cpu-moe --moe-cache-mib 16000 $v 2>&1
  done > "$OUT/bench_switches.md"; cat "$OUT/bench_switches.md"; keep bench_switches.md
  ;;
last)
  # All-GPU pp4096 at ubatch 512 once the reference file's writes have settled, then the server under load.
  reference 15
  timeout 60 python3 -m moestream bench -m $REF -p 4096 -n 64 -ub 512 -b 4096 -r 2 2>&1 | tee "$OUT/bench_gpu_512.md"
  ms serve -m $REF --cpu-moe --moe-cache-mib 16000 -np 8 -c 4096 --port 8080 > "$OUT/serve.log" 2>&1 &
  for i in $(seq 60); do python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:8080/health').status_code != 200)" 2>/dev/null && break; sleep 2; done
  timeout 120 python3 bench/serve_load.py --url http://127.0.0.1:8080 --clients 1,4,8 -p 512 -n 64 -r 2 2>&1 | tee "$OUT/serve_load.md"
  python3 -c "import httpx; print(httpx.get('http://127.0.0.1:8080/metrics').text)" 2>/dev/null | grep -E "^moestream_(expert|decode|prompt)" | head -20 | tee "$OUT/serve_metrics.txt"
  ;;
next)
  # What the last session could not run on the GPU: the cuda tests it added (read-through, shared reads, batched
  # zero-copy decode); tg64 at 8000 / 16000 / 24000 MiB with --read-through against the defaults (the hash must
  # match); the server with --shared-reads --read-through against the defaults.
  cuda_tests
  reference 15
  B="-m $REF -p 4096 -n 64 -ub 2048 -b 4096 -r 2 --cpu-moe --moe-cache-mib 8000,16000,24000"
  timeout 120 python3 -m moestream bench $B --read-through 2>&1 | tee "$OUT/bench_read_through.md"
  timeout 120 python3 -m moestream bench $B 2>&1 | tee "$OUT/bench_default.md"
  for v in "" "--shared-reads --read-through"; do                # the server with and without the two options
    ms serve -m $REF --cpu-moe --moe-cache-mib 16000 -np 8 -c 4096 --port 8080 $v > "$OUT/serve.log" 2>&1 &
    SP=$!
    for i in $(seq 40); do python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:8080/health').status_code != 200)" 2>/dev/null && break; sleep 2; done
    echo "## serve $v"; timeout 60 python3 bench/serve_load.py --url http://127.0.0.1:8080 --clients 1,4,8 -p 512 -n 64 -r 2 2>&1
    kill $SP; wait $SP
  done | tee "$OUT/serve_options.md"
  ;;
steps)
  # Where a decode step's time goes (bench/decode_steps.py): all on the GPU, and at 16000 / 24000 MiB with and
  # without --read-through; then bench tg64 with --read-through against the defaults (the hash must match).
  cuda_tests
  reference 10
  timeout 100 python3 bench/decode_steps.py $REF 2>&1 | tee "$OUT/steps_gpu.md"
  timeout 120 python3 bench/decode_steps.py $REF --cpu-moe --moe-cache-mib 16000,24000 2>&1 | tee "$OUT/steps_cache.md"
  timeout 120 python3 bench/decode_steps.py $REF --cpu-moe --moe-cache-mib 16000,24000 --read-through 2>&1 | tee "$OUT/steps_rt.md"
  B="-m $REF -p 4096 -n 64 -ub 2048 -b 4096 -r 2 --cpu-moe --moe-cache-mib 8000,16000"
  timeout 100 python3 -m moestream bench $B --read-through 2>&1 | tee "$OUT/bench_read_through.md"
  ;;
steps2)
  # The decode kernel with 0-8 of a token's experts read from host; decode steps from position 0 after a prompt,
  # as bench tg runs them, step by step (wall, GPU, host reads).
  timeout 120 python3 bench/decode_kernel.py 2>&1 | tee "$OUT/decode_kernel.log"
  reference 5
  timeout 130 python3 bench/decode_steps.py $REF --cpu-moe --moe-cache-mib 16000,24000 --from-zero 2>&1 | tee "$OUT/steps_zero.md"
  timeout 130 python3 bench/decode_steps.py $REF --cpu-moe --moe-cache-mib 16000,8000 --from-zero --read-through 2>&1 | tee "$OUT/steps_zero_rt.md"
  ;;
host)
  # The host's share of a zero-copy decode step, by function, with and without --read-through (synth model).
  timeout 150 python3 bench/profile_host.py synth:qwen3-30b-a3b:layers=8 --mib 3000 --no-read-through 2>&1 | tee "$OUT/profile_host.txt"
  timeout 150 python3 bench/profile_host.py synth:qwen3-30b-a3b:layers=8 --mib 3000 2>&1 | tee "$OUT/profile_host_rt.txt"
  ;;
prompt_host)
  # Issue 4's last gap: the host's time per layer in a prompt ubatch (GPU idle), by function, at 16000 MiB.
  reference 5
  timeout 200 python3 bench/profile_host.py $REF --prompt -ub 4096 --mib 16000 2>&1 | tee "$OUT/profile_prompt.txt"
  ;;
timeline)
  # Issue 4's gap to its bound: the copy and compute streams of one warm prompt (bench/prompt_timeline.py, the
  # traces come back), at ubatch 4096 and 2048, 16000 MiB; then the host's calls in a prompt (cProfile).
  cuda_tests
  reference 5
  for ub in 4096 2048 512; do
    timeout 120 python3 bench/prompt_timeline.py $REF "$OUT" -ub $ub 2>&1 | grep -v "^USDT"
  done | tee "$OUT/timeline.txt"
  timeout 150 python3 bench/profile_host.py $REF --prompt -ub 4096 --mib 16000 2>&1 | tee "$OUT/profile_prompt.txt"
  ;;
fill)
  # Copying two or more layers ahead while the host waits (--lookahead-layers): cuda tests; the prompt timeline;
  # bench pp4096 at ubatch 512/2048/4096, 16000 MiB, guessing 1 / 2 / 3 layers ahead (the hash must match).
  cuda_tests
  reference 5
  for ub in 4096 2048; do
    timeout 100 python3 bench/prompt_timeline.py $REF "$OUT" -ub $ub 2>&1 | grep -v "^USDT\|Warn\|warn"
  done | tee "$OUT/timeline.txt"
  cached_prompts 2 bench_fill.md "--lookahead-layers 1" "--lookahead-layers 2" "--lookahead-layers 3"
  ;;
rows)
  # Issue 4's rows after the fill: the defaults, no seeding, no prefetch, one layer ahead (as before the fill).
  reference 5
  cached_prompts 3 bench_rows.md "" "--no-prefetch-seed" "--no-prefetch" "--lookahead-layers 1"
  ;;
launchfill)
  # The fill also once each layer's experts are queued: cuda tests; the defaults against one layer ahead (no fill).
  cuda_tests
  reference 5
  cached_prompts 4 bench_launchfill.md "" "--lookahead-layers 1"
  ;;
final11)
  # Stop 11's last commit: the cuda tests; the defaults at ubatch 2048 / 4096, 16000 MiB.
  cuda_tests
  reference 3
  timeout 80 python3 -m moestream bench -m $REF -p 4096 -n 64 -ub 2048,4096 -b 4096 -r 3 --cpu-moe \
    --moe-cache-mib 16000 2>&1 | tee "$OUT/bench_final11.md"
  ;;
decode)
  # The decode rows after this session's changes: cuda tests; tg64 (and pp4096) at ubatch 2048 over the caches,
  # the defaults against --read-through (the hash must match); the server's one-stream decode with it.
  cuda_tests
  reference 5
  B="-m $REF -p 4096 -n 64 -ub 2048 -b 4096 -r 2 --cpu-moe"
  timeout 150 python3 -m moestream bench $B --moe-cache-mib 0,8000,16000,24000 2>&1 | tee "$OUT/bench_default.md"
  timeout 120 python3 -m moestream bench $B --moe-cache-mib 8000,16000,24000 --read-through 2>&1 | tee "$OUT/bench_read_through.md"
  ms serve -m $REF --cpu-moe --moe-cache-mib 16000 -np 8 -c 4096 --port 8080 --read-through > "$OUT/serve.log" 2>&1 &
  SP=$!
  for i in $(seq 40); do python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:8080/health').status_code != 200)" 2>/dev/null && break; sleep 2; done
  timeout 50 python3 bench/serve_load.py --url http://127.0.0.1:8080 --clients 1,4 -p 512 -n 64 -r 2 2>&1 | tee "$OUT/serve_rt.md"
  kill $SP; wait $SP
  ;;
confirm)
  # The defaults after turning read-through on: cuda tests; bench at 0 and 16000 MiB (the hash must match).
  cuda_tests
  reference 5
  timeout 100 python3 -m moestream bench -m $REF -p 4096 -n 64 -ub 2048 -b 4096 -r 2 --cpu-moe --moe-cache-mib 0,16000 2>&1 | tee "$OUT/bench_defaults.md"
  ;;
rest)
  # What the final run left out: prefetch without seeding, no lookahead, the first chunk copying every expert, and
  # a routing trace with lookahead guesses for `moestream replay --prefetch` (brought back as ref_trace.npz).
  reference
  B="-m $REF -p 4096 -n 64 -ub 512,2048,4096 -b 4096 -r 2"
  for v in "--no-prefetch-seed" "--no-lookahead" "--prefetch-first-all"; do
    echo "## --cpu-moe --moe-cache-mib 16000 $v"; timeout 90 python3 -m moestream bench $B --cpu-moe --moe-cache-mib 16000 $v 2>&1
  done | tee "$OUT/bench_prefetch_rest.md"
  timeout 150 python3 bench/probe.py $REF "$OUT" trace 2>&1 | tail -3
  ;;
kernel)
  # The decode expert kernel (bench/decode_kernel.py), the cuda tests, and where an all-GPU decode step's time goes.
  cuda_tests -x
  timeout 200 python3 bench/decode_kernel.py --sweep 2>&1 | tee "$OUT/decode_kernel.log"
  timeout 120 python3 bench/profile_decode.py synth:qwen3-30b-a3b:layers=4 > "$OUT/profile_decode.log" 2>&1; head -40 "$OUT/profile_decode.log"
  ;;
zc)
  # Zero-copy decode: cuda tests, the kernel's block shapes, decode on the reference model all-GPU and cached.
  cuda_tests -x
  [ -n "${SWEEP:-}" ] && { timeout 150 python3 bench/decode_kernel.py --sweep > "$OUT/decode_kernel.log" 2>&1; head -6 "$OUT/decode_kernel.log"; sort -t: -k2 -n "$OUT/decode_kernel.log" | grep gate_up | head -5; }
  timeout 120 python3 bench/profile_decode.py synth:qwen3-30b-a3b:layers=4 > "$OUT/profile_decode.log" 2>&1; head -36 "$OUT/profile_decode.log"
  reference
  B="-m $REF -p 4096 -n 64 -ub 2048 -b 4096 -r 2"
  timeout 60 python3 -m moestream bench $B 2>&1 | tee "$OUT/zc_gpu.md"
  timeout 150 python3 -m moestream bench $B --cpu-moe --moe-cache-mib ${SIZES:-0,8000,16000,24000} 2>&1 | tee "$OUT/zc_cache.md"
  timeout 60 python3 -m moestream bench $B --cpu-moe --moe-cache-mib 16000 --no-zero-copy-decode 2>&1 | tee "$OUT/zc_off.md"
  ;;
probe)
  cuda_tests -x
  reference
  timeout 200 python3 bench/probe.py $REF "$OUT" gpu > "$OUT/probe_gpu.log" 2>&1
  PROBE_TAG=_2 timeout 200 python3 bench/probe.py $REF "$OUT" gpu > "$OUT/probe_gpu_2.log" 2>&1
  python3 bench/probe.py - "$OUT" compare "$OUT/probe_gpu.json" "$OUT/probe_gpu_2.json" | tee "$OUT/compare_gpu.txt"
  if grep -q "differs in \[" "$OUT/compare_gpu.txt"; then        # across processes: is it cuDNN's attention?
    PROBE_TAG=_nocudnn PROBE_CUDNN_SDP=0 timeout 200 python3 bench/probe.py $REF "$OUT" gpu > "$OUT/probe_gpu_nc.log" 2>&1
    PROBE_TAG=_nocudnn2 PROBE_CUDNN_SDP=0 timeout 200 python3 bench/probe.py $REF "$OUT" gpu > "$OUT/probe_gpu_nc2.log" 2>&1
    python3 bench/probe.py - "$OUT" compare "$OUT/probe_gpu_nocudnn.json" "$OUT/probe_gpu_nocudnn2.json" | tee -a "$OUT/compare_gpu.txt"
  fi
  timeout 400 python3 bench/probe.py $REF "$OUT" cache 2>&1 | grep -v "^USDT\|Warning" | tee "$OUT/probe_cache.log" | grep -v '^{'
  python3 bench/probe.py - "$OUT" compare "$OUT/probe_gpu.json" "$OUT/probe_cache.json" | tee "$OUT/compare_cache.txt"
  (cd "$OUT" && tar czf probe.tgz --remove-files *.json *.log *.txt)
  ;;
esac
