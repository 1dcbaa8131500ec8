#!/bin/bash
# On a lent GPU machine: the CUDA tests, `roseinfer bench --device cuda` on the issue's workloads, and the queue
# through a redis-server. Usage: bash benchmarks/gpu_check.sh [all|queue|tests|smol|1b|queue-engine-process|timeline|
# queue-profile] ...
# (several parts in one call run in the order given); logs packed into $OUT/gpu-check.tgz. Made beforehand here by
# `bash benchmarks/gpu_prepare.sh`, and carried: .gpu-pack, .gpu-model.
#
# A session's device time is short (15 minutes, the machine's start included), so the whole call keeps within
# GPU_CHECK_BUDGET seconds (default 530: run it with timeout_s 570, under the tool's 600 s limit): `all` runs the parts in the order of what is
# still unmeasured (the queue, then parity, then the engine's rows, then the queue with its engine in a process of its
# own and the queue's timeline), each with a cap of its own, and a part that would not fit in what is left is skipped,
# saying so, rather than cut off with nothing written. The caps add up past one call's budget: `all` measures what
# fits, in that order, and a second call names the parts left (queue-profile is never part of `all`).
# The logs go to a folder of their own, packed into $OUT/gpu-check.tgz after every part and every 20 s (written
# aside and moved over it: a pack cut off midway never leaves a broken archive): the device tool brings back 8 files
# at most (a run writes a dozen), and a run cut off at its limit still brings back what every part wrote.
# GPU_CHECK_PARSE_ONLY=1 (here, in gpu_prepare.sh, and in the tests): each roseinfer command line parsed, nothing
# run: a flag a command no longer takes failed both queue runs on the device in 2 s.
set -u
out=${OUT:-out}; mkdir -p "$out"
parse_only=${GPU_CHECK_PARSE_ONLY:-}
logs=${GPU_CHECK_LOGS:-/tmp/gpu-check}; [[ -n $parse_only ]] && logs=$(mktemp -d); mkdir -p "$logs"
budget=${GPU_CHECK_BUDGET:-530}
start=$SECONDS
[[ -z $parse_only ]] && source .gpu-pack/activate.sh
export PYTHONPATH=${PYTHONPATH:-}:$PWD PYTHONUNBUFFERED=1
# The random models (built once per shape and dtype) and compiled kernels: a place sure to be writable there.
export ROSEINFER_CACHE_DIR=${ROSEINFER_CACHE_DIR:-/tmp/roseinfer-cache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
# No network there: a path read as a hub id fails at once, not after connection timeouts.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
parts=("$@"); [[ ${#parts[@]} == 0 ]] && parts=(all)
all=(queue tests smol 1b queue-engine-process timeline)
expanded=(); for p in "${parts[@]}"; do [[ $p == all ]] && expanded+=("${all[@]}") || expanded+=("$p"); done
parts=("${expanded[@]}")  # (all among others: its parts and the others, in the order given)
# (a part file of each packing process's own: the packer's and a part's end can overlap)
pack() { local part="$out/.gpu-check.$BASHPID.part"
  tar czf "$part" -C "$logs" . 2>/dev/null && mv -f "$part" "$out/gpu-check.tgz"; rm -f "$part"; }
# What a part cut at its cap leaves running (its workers, their engine processes, its redis-server) is ended before
# the next: a cut run's workers held their GPU memory and CPU under the parts after it.
# (by /proc where the image has no pkill: its error was hidden, and nothing was ended)
leftovers() {
  local pattern="worker.cli worker|multiprocessing.spawn|redis-server"
  if command -v pkill >/dev/null; then pkill -9 -f "$pattern"; true; return; fi
  python3 - "$pattern" <<'PY'
import os, re, signal, sys
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        if int(pid) != os.getpid() and re.search(sys.argv[1], cmdline):
            os.kill(int(pid), signal.SIGKILL)
    except (OSError, ValueError):
        pass
PY
}
if [[ -n $parse_only ]]; then
  roseinfer=(python3 -c "import sys; from worker.cli import build_parser; build_parser().parse_args(sys.argv[1:])")
  timeout() { while [[ $1 == -* ]]; do shift 2; done; shift; "$@"; }  # (no caps: nothing runs)
else
(while sleep 20; do pack; done) & packer=$!  # (what a part writes comes back even when the call is cut inside it)
trap 'kill $packer 2>/dev/null' EXIT
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,compute_mode --format=csv,noheader | tee "$logs/gpu.txt"
# What the parts need of the machine, said in a second rather than found out minutes in: Triton compiles its
# launcher with a C compiler and Python's headers; the queue's parts need the carried redis-server to start.
{
  cc=$(command -v cc gcc clang | head -1); echo "C compiler: ${cc:-none, so Triton kernels cannot build}"
  python3 -c "import sysconfig, os; h = sysconfig.get_paths()['include']; print(h if os.path.exists(h + '/Python.h') else 'no Python.h: Triton cannot build')"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  redis-server --version || echo "the carried redis-server does not start here: the queue parts will fail"
} 2>&1 | tee "$logs/preflight.txt"
# The pack itself, in a second: without its packages or the tokenizer every part would fail in turn, the lease spent.
# (not through a pipe: its status was tee's, and a pack that did not install went on into every part)
if ! python3 -c "import redis, rq, pydantic, pydantic_settings, hiredis, llguidance, prometheus_client, xdist" \
    >>"$logs/preflight.txt" 2>&1 || [[ ! -f .gpu-model/smollm2-tok/tokenizer.json ]]; then
  tail -5 "$logs/preflight.txt"
  echo "the pack did not install, or .gpu-model was not carried: carry [\".gpu-pack\", \".gpu-model\"]" | tee -a "$logs/preflight.txt"
  pack; exit 3
fi
roseinfer=(python3 -c "import sys; from worker.cli import main; sys.exit(main(sys.argv[1:]))")
fi
# within NEED CAP: the seconds this part may take (CAP, or what is left of the budget), or nothing when fewer than
# NEED are left.
within() {
  local left=$((budget - (SECONDS - start)))
  if ((left < $1)); then echo "skipped: ${left}s left of ${budget}s, the part needs ${1}s" | tee -a "$logs/parts.log" >&2; return 1; fi
  echo $((left < $2 ? left : $2))
}
bench() {
  local t; t=$(within "$1" "$2") || return
  timeout -k 15 "$t" "${roseinfer[@]}" bench --device cuda "${@:3}" 2>&1 | grep -v "Loading weights" | tee -a "$logs/bench.log"
  echo "rc ${PIPESTATUS[0]} (124: cut at its cap)" >>"$logs/parts.log"
}
queue() {  # SmolLM2's shape with its real tokenizer (carried in .gpu-model), 256 chat jobs x 128 tokens
  local t; t=$(within "$1" "$2") || return
  timeout -k 15 "$t" "${roseinfer[@]}" bench-queue --device cuda --model random:smollm2-135m --tokenizer .gpu-model/smollm2-tok \
    --dtype bfloat16 --num-prompts 256 --max-tokens 128 --max-num-seqs 256 --stock-jobs 0 --repeats 2 --arrivals 16 \
    --arrival-interval 0.1 --worker-log "$logs/queue-workers.log" "${@:3}" 2>&1 \
    | grep -v -E "Loading weights|Writing model" | tee -a "$logs/queue.log"
  echo "rc ${PIPESTATUS[0]} (124: cut at its cap)" >>"$logs/parts.log"
}
for part in "${parts[@]}"; do
  echo "== $part at $((SECONDS - start))s" | tee -a "$logs/parts.log"
  case $part in
    queue)  # the worker as one process
      queue 60 150 --json "$logs/queue.json" ;;
    queue-engine-process)  # the worker with its engine in a process of its own
      queue 60 150 --worker-flag=--engine-process --json "$logs/queue-engine-process.json" ;;
    tests)  # -v, the whole log kept: a run cut off at its cap still names every test that ran; no -x: one failure
      # must not hide what the others would have said, on a machine lent for minutes. The CUDA tests (never run on a
      # GPU yet): the parity ones first, which the issue asks for, then the kernels' own, many of whose float32
      # variants compile cold (about 100 of 1-4 s: the cap would have ended inside the parity tests); a test stuck
      # on a worker gives up at 60 s, not the ini's 300
      [[ -n $parse_only ]] || { t=$(within 60 150) && { timeout -k 15 "$t" python3 -m pytest -p no:cacheprovider \
        --timeout 60 tests/test_cuda.py tests/test_triton_kernels.py -v 2>&1 | tee "$logs/tests.log" | tail -30
        echo "rc ${PIPESTATUS[0]} (124: cut at its cap)" >>"$logs/parts.log"; }; } ;;
    smol)
      bench 60 150 --model random:smollm2-135m --dtype bfloat16 --num-prompts 64 --max-tokens 64 --repeats 3 \
        --json "$logs/smol64.json" ;;
    1b)
      bench 45 100 --model random:llama-1b --dtype bfloat16 --num-prompts 64 --max-tokens 64 --repeats 3 --latency \
        --skip-hf
      bench 45 100 --model random:llama-1b --dtype bfloat16 --num-prompts 256 --max-tokens 256 --max-num-seqs 256 \
        --skip-hf --repeats 3 ;;
    timeline)  # where a 256-job burst's time goes inside the worker: its pulls, reads, steps and sends, timed
      # (parse-only too: the script parses its flags and stops)
      t=$(within 60 120) && { timeout -k 15 "$t" python3 benchmarks/worker_timeline.py --device cuda \
        --model random:smollm2-135m --tokenizer .gpu-model/smollm2-tok --dtype bfloat16 --jobs 256 --tokens 128 \
        --max-num-seqs 256 --worker-log "$logs/timeline-worker.log" 2>&1 \
        | grep -v -E "Loading weights|Writing model|Acquired" | tee -a "$logs/timeline.log"
        echo "rc ${PIPESTATUS[0]} (124: cut at its cap)" >>"$logs/parts.log"; } ;;
    queue-profile)  # the queue under py-spy (carried in .gpu-pack): every thread of the bench and of its worker
      # (SIGINT at the cap: py-spy writes its file then; SIGTERM stopped it first)
      profile=(py-spy record --subprocesses --threads --nonblocking --format raw -o "$logs/queue-profile.txt" --)
      [[ -n $parse_only ]] && profile=()
      # (its figures kept too: a profiled run's, beside the profile)
      t=$(within 90 300) && { timeout -k 30 -s INT "$t" "${profile[@]}" "${roseinfer[@]}" bench-queue --device cuda \
        --model random:smollm2-135m --tokenizer .gpu-model/smollm2-tok --dtype bfloat16 \
        --num-prompts 256 --max-tokens 128 --max-num-seqs 256 --stock-jobs 0 --repeats 2 --arrivals 16 \
        --arrival-interval 0.1 --json "$logs/queue-profile.json" 2>&1 | grep -v -E "Loading weights|Writing model" \
        | tee -a "$logs/queue-profile.log" | tail -12
        echo "rc ${PIPESTATUS[0]} (124: cut at its cap)" >>"$logs/parts.log"; } ;;
    *) echo "unknown part: $part (all, queue, tests, smol, 1b, queue-engine-process, timeline, queue-profile)" >&2
      exit 2 ;;
  esac
  [[ -n $parse_only ]] || { leftovers; pack; }
done
echo "== done at $((SECONDS - start))s of ${budget}s" | tee -a "$logs/parts.log"
if [[ -n $parse_only ]]; then ! grep -q "^rc [1-9]" "$logs/parts.log"; exit; fi
kill $packer 2>/dev/null; wait $packer 2>/dev/null
pack; rm -f "$out"/.gpu-check.*.part  # (one the packer was writing as it was stopped)
