#!/bin/bash
# On a lent GPU machine: the CUDA tests, then `roseinfer bench --device cuda` on the issue's workloads, or the queue
# through a redis-server. Usage: bash benchmarks/gpu_check.sh [tests|smol|1b|all|queue|queue-profile]; logs under $OUT
# (or ./out). Made beforehand on this machine by `bash benchmarks/gpu_prepare.sh`, and carried: .gpu-pack, .gpu-model.
set -u
out=${OUT:-out}; mkdir -p "$out"
source .gpu-pack/activate.sh
export PYTHONPATH=$PYTHONPATH:$PWD PYTHONUNBUFFERED=1
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
bench() { timeout "$1" python3 -c "import sys; from worker.cli import main; sys.exit(main(sys.argv[1:]))" bench --device cuda "${@:2}" 2>&1 | grep -v "Loading weights" | tee -a "$out/bench.log"; }
if [[ $what == tests || $what == all ]]; then
  timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_kernels.py tests/test_cuda.py 2>&1 | tail -30 | tee "$out/tests.log"
fi
if [[ $what == smol || $what == all ]]; then
  bench 200 --model random:smollm2-135m --dtype bfloat16 --num-prompts 64 --max-tokens 64 --repeats 3 --json "$out/smol64.json"
fi
if [[ $what == 1b || $what == all ]]; then
  bench 150 --model random:llama-1b --dtype bfloat16 --num-prompts 64 --max-tokens 64 --repeats 3 --latency --skip-hf
  bench 150 --model random:llama-1b --dtype bfloat16 --num-prompts 256 --max-tokens 256 --max-num-seqs 256 --skip-hf
fi
if [[ $what == queue || $what == all ]]; then
  # SmolLM2's shape with its real tokenizer (carried in .gpu-model), 256 chat jobs x 128 tokens through a redis-server:
  # the worker as one process, then with its engine in a process of its own (--engine-process).
  for flags in "" "--worker-flag=--engine-process"; do
    timeout 300 python3 -c "import sys; from worker.cli import main; sys.exit(main(sys.argv[1:]))" bench-queue \
      --device cuda --model random:smollm2-135m --tokenizer .gpu-model/smollm2-tok --dtype bfloat16 --num-prompts 256 \
      --max-tokens 128 --max-num-seqs 256 --stock-jobs 0 --repeats 2 --arrivals 16 --arrival-interval 0.1 $flags \
      --skip-hf --json "$out/queue${flags:+-engine-process}.json" 2>&1 | grep -v -E "Loading weights|Writing model" \
      | tee -a "$out/queue.log"
  done
fi
if [[ $what == queue-profile ]]; then
  # The same, under py-spy (carried in .gpu-pack): every thread of the bench and of the worker it starts, sampled.
  timeout 400 py-spy record --subprocesses --threads --nonblocking --format raw -o "$out/queue-profile.txt" -- \
    python3 -c "import sys; from worker.cli import main; sys.exit(main(sys.argv[1:]))" bench-queue \
    --device cuda --model random:smollm2-135m --tokenizer .gpu-model/smollm2-tok --dtype bfloat16 --num-prompts 256 \
    --max-tokens 128 --max-num-seqs 256 --stock-jobs 0 --repeats 2 --arrivals 16 --arrival-interval 0.1 \
    --skip-hf --json "$out/queue.json" 2>&1 | grep -v -E "Loading weights|Writing model" | tail -12
fi
