#!/bin/bash
# On a lent GPU machine: the CUDA tests, `roseinfer bench --device cuda` on the issue's workloads, and the queue
# through a redis-server. Usage: bash benchmarks/gpu_check.sh [all|queue|tests|smol|1b|timeline|queue-profile] ...
# (several parts in one call run in the order given); logs under $OUT (or ./out). Made beforehand on this machine by
# `bash benchmarks/gpu_prepare.sh`, and carried: .gpu-pack, .gpu-model.
#
# A session's device time is short (15 minutes, the machine's start included), so the whole call keeps within
# GPU_CHECK_BUDGET seconds (default 500, under the tool's 600 s limit): `all` runs the parts in the order of what is
# still unmeasured (the queue, then parity, then the engine's rows, then the queue's timeline), each with a cap of its own, and a part that
# would not fit in what is left is skipped, saying so, rather than cut off with nothing written.
set -u
out=${OUT:-out}; mkdir -p "$out"
budget=${GPU_CHECK_BUDGET:-500}
start=$SECONDS
source .gpu-pack/activate.sh
export PYTHONPATH=$PYTHONPATH:$PWD PYTHONUNBUFFERED=1
# The random models (built once per shape and dtype) and compiled kernels: a place sure to be writable there.
export ROSEINFER_CACHE_DIR=${ROSEINFER_CACHE_DIR:-/tmp/roseinfer-cache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
parts=("$@"); [[ ${#parts[@]} == 0 || ${parts[0]} == all ]] && parts=(queue tests smol 1b timeline)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,compute_mode --format=csv,noheader | tee "$out/gpu.txt"
# What the parts need of the machine, said in a second rather than found out minutes in: Triton compiles its
# launcher with a C compiler and Python's headers; the queue's parts need the carried redis-server to start.
{
  cc=$(command -v cc gcc clang | head -1); echo "C compiler: ${cc:-none, so Triton kernels cannot build}"
  python3 -c "import sysconfig, os; h = sysconfig.get_paths()['include']; print(h if os.path.exists(h + '/Python.h') else 'no Python.h: Triton cannot build')"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  redis-server --version || echo "the carried redis-server does not start here: the queue parts will fail"
} 2>&1 | tee "$out/preflight.txt"
roseinfer=(python3 -c "import sys; from worker.cli import main; sys.exit(main(sys.argv[1:]))")
# within NEED CAP: the seconds this part may take (CAP, or what is left of the budget), or nothing when fewer than
# NEED are left.
within() {
  local left=$((budget - (SECONDS - start)))
  if ((left < $1)); then echo "skipped: ${left}s left of ${budget}s, the part needs ${1}s" | tee -a "$out/skipped.log" >&2; return 1; fi
  echo $((left < $2 ? left : $2))
}
bench() { local t; t=$(within "$1" "$2") || return; timeout "$t" "${roseinfer[@]}" bench --device cuda "${@:3}" 2>&1 | grep -v "Loading weights" | tee -a "$out/bench.log"; }
queue() {  # SmolLM2's shape with its real tokenizer (carried in .gpu-model), 256 chat jobs x 128 tokens
  local t; t=$(within "$1" "$2") || return
  timeout "$t" "${roseinfer[@]}" bench-queue --device cuda --model random:smollm2-135m --tokenizer .gpu-model/smollm2-tok \
    --dtype bfloat16 --num-prompts 256 --max-tokens 128 --max-num-seqs 256 --stock-jobs 0 --repeats 2 --arrivals 16 \
    --arrival-interval 0.1 --skip-hf --worker-log "$out/queue-workers.log" "${@:3}" 2>&1 \
    | grep -v -E "Loading weights|Writing model" | tee -a "$out/queue.log"
}
for part in "${parts[@]}"; do
  echo "== $part at $((SECONDS - start))s" | tee -a "$out/parts.log"
  case $part in
    queue)  # the worker as one process, then with its engine in a process of its own
      queue 60 150 --json "$out/queue.json"
      queue 60 150 --worker-flag=--engine-process --json "$out/queue-engine-process.json" ;;
    tests)  # -v, the whole log kept: a run cut off at its cap still names every test that ran; no -x: one failure
      # must not hide what the others would have said, on a machine lent for minutes
      t=$(within 60 200) && timeout "$t" python3 -m pytest -p no:cacheprovider tests/test_triton_kernels.py \
        tests/test_cuda.py -v 2>&1 | tee "$out/tests.log" | tail -30 ;;
    smol)
      bench 60 150 --model random:smollm2-135m --dtype bfloat16 --num-prompts 64 --max-tokens 64 --repeats 3 \
        --json "$out/smol64.json" ;;
    1b)
      bench 45 100 --model random:llama-1b --dtype bfloat16 --num-prompts 64 --max-tokens 64 --repeats 3 --latency \
        --skip-hf
      bench 45 100 --model random:llama-1b --dtype bfloat16 --num-prompts 256 --max-tokens 256 --max-num-seqs 256 \
        --skip-hf ;;
    timeline)  # where a 256-job burst's time goes inside the worker: its pulls, reads, steps and sends, timed
      t=$(within 60 120) && timeout "$t" python3 benchmarks/worker_timeline.py --device cuda --model random:smollm2-135m \
        --tokenizer .gpu-model/smollm2-tok --dtype bfloat16 --jobs 256 --tokens 128 --max-num-seqs 256 \
        --worker-log "$out/timeline-worker.log" 2>&1 \
        | grep -v -E "Loading weights|Writing model|Acquired" | tee -a "$out/timeline.log" ;;
    queue-profile)  # the queue under py-spy (carried in .gpu-pack): every thread of the bench and of its worker
      t=$(within 90 300) && timeout "$t" py-spy record --subprocesses --threads --nonblocking --format raw \
        -o "$out/queue-profile.txt" -- "${roseinfer[@]}" bench-queue --device cuda --model random:smollm2-135m \
        --tokenizer .gpu-model/smollm2-tok --dtype bfloat16 \
        --num-prompts 256 --max-tokens 128 --max-num-seqs 256 --stock-jobs 0 --repeats 2 --arrivals 16 \
        --arrival-interval 0.1 --skip-hf 2>&1 | grep -v -E "Loading weights|Writing model" | tail -12 ;;
    *) echo "unknown part: $part (all, queue, tests, smol, 1b, timeline, queue-profile)" >&2; exit 2 ;;
  esac
done
echo "== done at $((SECONDS - start))s of ${budget}s" | tee -a "$out/parts.log"
